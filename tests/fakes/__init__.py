"""In-memory fakes of retrain's ports, for the unit tier.  Each is held to the real adapter by a
behaviour suite in ``tests/ports/`` that runs the same tests against both (the real one on its
emulator), so that a fake cannot drift from the service it stands for."""
