from retrain.tokenize.cli import main

raise SystemExit(main())
