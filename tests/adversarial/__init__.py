"""The adversarial suite: attacks on every surface a stranger or an unlucky operator can reach
(the slab server's port, node commands on the broker, the scheduler's HTTP API, every file reader).

Each test names in its docstring the promise it checks, so that a regression fails it; each runs
in bounded time (pytest-timeout, and explicit deadlines on every wait)."""
