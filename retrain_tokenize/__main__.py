from retrain_tokenize.cli import main

raise SystemExit(main())
