"""What the test suites share, one module for each thing it is: the fake driver (fake_driver), a
real server process (live_server), the engine's, fast path's and allocator's fixtures (engine,
fast_path, vmm), the server tests' helpers (server, storage), the end-to-end tests' (e2e), the
dashboard's (dashboard, dashboard_page), hostile text, and the GPU tests' (gpu, fresh_process,
torchrun, served_job). jobs/ holds the programs tests start by path. Tests import them as
``from support.fake_driver import FakeDriver``: tests/conftest.py puts tests/ on sys.path."""
