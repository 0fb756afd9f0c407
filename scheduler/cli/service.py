"""``dlshare sched``: the scheduler service (its ``[sched]`` settings, start-up, HTTPS and stop).  The API's
client commands, ``dlshare job`` and ``dlshare token``, are :mod:`scheduler.cli.jobs`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from nodesvc.bus import config, jobenv
from nodesvc.bus.commands import check_broker

log = logging.getLogger("dlshare.sched")


def _default_db() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "dlshare", "sched.db")


config.register_section("sched", {
    "listen": "127.0.0.1:7800",
    "db": _default_db(),
    "token": "",  # empty: generated at first start, stored beside the DB as <db>.token (mode 0600)
    # The bootstrap token above is an admin acting as this user (its jobs run as it on the nodes);
    # empty: the service's own user.  Users get their own tokens from `dlshare token create`.
    "token_user": "",
    "token_ttl_s": 90 * 86400.0,  # `dlshare token create`'s default lifetime (90 days)
    # Admission: the most jobs one user (one account) may have waiting, queued or preempted;
    # more get 429 with the reason.  0: no limit.
    "max_waiting_per_user": 0,
    "max_waiting_per_account": 0,
    # The environment variables a job spec may set (README, Security; the nodes check their own lists).
    "job_env_allow": list(jobenv.DEFAULT_ALLOW),
    "job_env_deny": list(jobenv.DEFAULT_DENY),
    "profile": "dlshare",
    "synchronous": "FULL",  # SQLite: FULL survives power loss, NORMAL survives a process kill only
    "tick_s": 2.0,
    "command_timeout_s": 10.0,
    "node_timeout_s": 30.0,
    "url": "",  # for `dlshare job`: the service's URL (default http(s)://<listen>)
    # HTTPS: the API's certificate and key (PEM); both empty: plain HTTP (README, "HTTPS for the scheduler API").
    "tls_cert_file": "",
    "tls_key_file": "",
    "ca_file": "",  # for `dlshare job` and `dlshare token`: the CA that signed the API's certificate
    # With HTTPS: a client certificate signed by this CA may call /k8s/* without a token (kube-scheduler's
    # extender client sends a certificate, never a token: tlsConfig certFile/keyFile); empty: none asked for.
    "k8s_client_ca_file": "",
    "tls_reload_s": 60.0,  # look for a renewed certificate and key this often (0: never; a restart reloads)
    "k8s_open": False,  # serve /k8s/* without the token (kube-scheduler sends none; restrict by network)
    "predictors": "data",  # data: trained on the shared data (Gavel, Synergy) at start; default: uninformed
    # Talk to the API server: list the dlshare pods every second (PodSync: the core holds what the API
    # server has bound, frees what ended) and, for /k8s/bind (bindVerb), post the pod's v1.Binding first.
    # false: /k8s/bind only records (the pods stay Pending unless something else binds them).
    "k8s_bind": False,
    "k8s_order": False,  # the extender refuses a pod while one ahead of it in dlshare's order fits (needs k8s_bind)
    "k8s_api": "",  # API server URL; empty: in-cluster, https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    "k8s_token_file": "/var/run/secrets/kubernetes.io/serviceaccount/token",  # re-read per bind; empty: no token
    "k8s_ca_file": "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",  # empty: the system CAs
    "k8s_timeout_s": 4.0,  # per Binding request; keep below the extender's httpTimeout (5s)
    # The HTTP API's ceilings (README, Security): larger bodies get 413, connections beyond the cap 503,
    # a request not all in within request_timeout_s of its first byte is dropped, an idle one after keep_alive_s.
    "max_body_bytes": 8 << 20,
    "max_connections": 256,
    "request_timeout_s": 10.0,
    "keep_alive_s": 5.0,
    # The HTTP API on its own thread, so node replies and telemetry never wait behind requests.
    "api_thread": True,
    # Snapshot the core and compact its log every this many events: a restart replays at most these.
    # 2,000: ~1-2 s of replay on a loaded 2-vCPU VM (bench/RESULTS.md, sched-service restart).
    "snapshot_events": 2000,
    "snapshot_s": 120.0,  # and at least this often while events come
    # ... and once the core spent this long on the batches since the last snapshot: a restart's replay
    # redoes that work, so it stays about this long whatever the events' mix (1,000 nodes reporting).
    "snapshot_core_s": 1.0,
    # Waiting jobs: their reasons every reasons_s, their start estimates (the queue replayed through the
    # core) every forecast_s or when the queue changes (README, "Operating dlshare").
    "reasons_s": 1.0,
    "forecast_s": 10.0,
    "reason_event_gap_s": 300.0,  # a waiting job's events: a new cause at once, new numbers at most this often
    # The cluster over time: one point every history_step_s, kept history_keep_s (in the database too).
    "history_step_s": 10.0,
    "history_keep_s": 86400.0,
    # GET /metrics without a token (a scraper on a trusted network); by default it needs one, which
    # Prometheus sends from a file (deploy/prometheus/prometheus.yml).
    "metrics_open": False,
    "backoff_s": 0.5,  # a job whose start failed waits this long before it is placed again, doubling to 30 s
    "vanish_after_s": 15.0,  # a started job its node no longer lists this long has vanished (3 daemon periods)
})


def tls_files(s: dict[str, Any]) -> tuple[str, str, str] | None:
    """The API's certificate, key and client CA (None: plain HTTP), checked to load: a missing,
    unreadable or non-PEM file, a key that is not the certificate's, or a client CA without HTTPS is a
    config error before anything listens."""
    import ssl

    from nodesvc.bus import tls

    cert, key, client_ca = (str(s[k] or "") for k in ("tls_cert_file", "tls_key_file", "k8s_client_ca_file"))
    if not cert and not key:
        if client_ca:
            raise config.ConfigError("sched.k8s_client_ca_file needs HTTPS: give sched.tls_cert_file and "
                                     "sched.tls_key_file too")
        return None
    if not cert or not key:
        raise config.ConfigError("sched.tls_cert_file and sched.tls_key_file go together: give both, or neither")
    try:
        ctx = tls.server_context(cert, key, what="sched.tls_cert_file")
    except ValueError as exc:
        raise config.ConfigError(str(exc)) from None
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise config.ConfigError(f"sched.k8s_client_ca_file {client_ca!r}: {exc}") from None
    return cert, key, client_ca


def _predictors(kind: str):
    """The predictor bundle the core starts with; both learn online from telemetry."""
    from scheduler import Predictors

    if kind == "default":
        return Predictors.default()
    if kind != "data":
        raise config.ConfigError(f"sched.predictors must be 'data' or 'default', not {kind!r}")
    try:
        return Predictors.from_data()
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("predictors: the shared data is not usable (%s); starting uninformed", exc)
        return Predictors.default()


def api_url(host: str, port: int, https: bool = False) -> str:
    """The API's URL as others can use it: a wildcard listen address (0.0.0.0, ::) names this host."""
    import socket

    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{'https' if https else 'http'}://{host}:{port}"


def token_user(cfg: dict[str, dict[str, Any]]) -> str:
    """The user the bootstrap token acts as: ``sched.token_user``, else the service's own user."""
    import getpass

    return cfg["sched"]["token_user"] or getpass.getuser()


def _service(cfg: dict[str, dict[str, Any]], store):
    """The live service the ``[sched]`` settings describe (its core from the store's snapshot and
    log; the predictors are trained only when no snapshot holds them)."""
    from scheduler import WatchRules
    from scheduler.service.live import SchedulerService
    from scheduler.service.rows import WaitingLimits

    s = cfg["sched"]
    if not (0 <= s["max_waiting_per_user"] <= 1 << 30 and 0 <= s["max_waiting_per_account"] <= 1 << 30):
        raise config.ConfigError("sched.max_waiting_per_user and _per_account must be 0 (no limit) to 2^30")
    try:
        rules = WatchRules(backoff_s=float(s["backoff_s"]), vanish_after_s=float(s["vanish_after_s"]) or None)
    except ValueError as exc:
        raise config.ConfigError(f"sched.backoff_s / sched.vanish_after_s: {exc}") from None
    if int(s["snapshot_events"]) < 1 or float(s["snapshot_s"]) <= 0 or not 0 < float(s["snapshot_core_s"]) <= 3600:
        raise config.ConfigError("sched.snapshot_events must be >= 1, sched.snapshot_s > 0 and sched.snapshot_core_s "
                                 "between 0 and 3600")
    for key, lo, hi in (("reasons_s", 0.05, 3600.0), ("forecast_s", 0.05, 86400.0), ("history_step_s", 0.05, 3600.0),
                        ("reason_event_gap_s", 0.0, 86400.0),
                        ("history_keep_s", 1.0, 366 * 86400.0)):
        if not lo <= float(s[key]) <= hi:
            raise config.ConfigError(f"sched.{key} must be between {lo:g} and {hi:g}, got {s[key]!r}")
    if float(s["history_keep_s"]) / float(s["history_step_s"]) > 1_000_000 or s["history_keep_s"] < s["history_step_s"]:
        raise config.ConfigError("sched.history_keep_s must be 1 to 1,000,000 times sched.history_step_s")
    try:
        return SchedulerService(store, profile=s["profile"], predictors=lambda: _predictors(s["predictors"]),
                                broker_url=cfg["dlshare"]["broker"], tick_s=s["tick_s"],
                                command_timeout_s=s["command_timeout_s"], node_timeout_s=s["node_timeout_s"],
                                rules=rules, snapshot_events=int(s["snapshot_events"]),
                                snapshot_s=float(s["snapshot_s"]), snapshot_core_s=float(s["snapshot_core_s"]),
                                limits=WaitingLimits(int(s["max_waiting_per_user"]), int(s["max_waiting_per_account"])),
                                default_user=token_user(cfg), reasons_s=float(s["reasons_s"]),
                                forecast_s=float(s["forecast_s"]), history_step_s=float(s["history_step_s"]),
                                reason_event_gap_s=float(s["reason_event_gap_s"]),
                                history_keep_s=float(s["history_keep_s"]))
    except (ValueError, OSError) as exc:  # ProfileError, DataError (a profile whose prior needs the data)
        raise config.ConfigError(f"scheduling profile {s['profile']!r}: {exc}") from None


async def serve(cfg: dict[str, dict[str, Any]], stop: asyncio.Event | None = None,
                ready: asyncio.Event | None = None) -> None:
    """Run the service until ``stop`` is set or SIGINT/SIGTERM.  The live loop runs on this
    thread's event loop; with ``sched.api_thread`` the HTTP API runs on its own thread and loop."""
    import ssl
    import threading

    import uvicorn

    from nodesvc.bus import tls

    from nodesvc.bus.procs import split_hostport
    from scheduler.service.api import create_app
    from scheduler.service.http_limits import server_options
    from scheduler.service.k8s import PodSync
    from scheduler.service.k8s_api import BinderConfigError, binder_from_config
    from scheduler.service.store import JobStore, load_or_create_token
    from scheduler.service.tokens import TokenBook, TokenError

    s = cfg["sched"]
    host, port = split_hostport(s["listen"], 7800)
    for key, lo, hi in (("max_body_bytes", 1 << 10, 1 << 30), ("max_connections", 1, 1 << 16),
                        ("request_timeout_s", 0.1, 3600.0), ("keep_alive_s", 0.1, 3600.0),
                        ("tls_reload_s", 0.0, 86400.0)):
        if not lo <= s[key] <= hi:
            raise config.ConfigError(f"sched.{key} must be between {lo:g} and {hi:g}, got {s[key]!r}")
    try:
        binder = binder_from_config(s)
    except BinderConfigError as exc:
        raise config.ConfigError(str(exc)) from None
    broker = check_broker(cfg["dlshare"]["broker"]) if cfg["dlshare"]["broker"] else "none"
    https = tls_files(s)
    store = JobStore(s["db"], synchronous=s["synchronous"])
    try:
        token = load_or_create_token(s["db"], s["token"])
    except ValueError as exc:
        store.close()
        raise config.ConfigError(str(exc)) from None
    try:
        service = _service(cfg, store)
    except config.ConfigError:
        store.close()
        raise
    service.url = api_url(host, port, https is not None)
    service.k8s_binder = binder
    service.k8s_order = bool(s["k8s_order"]) and binder is not None  # the waiting pods come from PodSync
    if binder is not None:
        service.k8s_hold_s = None  # PodSync ends a bound pod's hold when the API server says the pod ended
    try:
        book = TokenBook(store, token, token_user(cfg))
        env_allow = jobenv.check_patterns(s["job_env_allow"], "sched.job_env_allow")
        env_deny = jobenv.check_patterns(s["job_env_deny"], "sched.job_env_deny")
    except (TokenError, ValueError) as exc:
        store.close()
        raise config.ConfigError(str(exc)) from None
    app = create_app(service, token, k8s_open=s["k8s_open"], max_body_bytes=s["max_body_bytes"], tokens=book,
                     env_allow=env_allow, env_deny=env_deny, metrics_open=bool(s["metrics_open"]))
    limits = server_options(s["max_connections"], s["request_timeout_s"], s["keep_alive_s"])
    if https is not None:
        limits.update(ssl_certfile=https[0], ssl_keyfile=https[1])
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                               **limits)
    if https is not None:
        uv_config.load()  # builds its TLS context, which then refuses anything before TLS 1.2
        uv_config.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        if https[2]:  # ask every client for a certificate; one that sends one must pass this CA
            uv_config.ssl.load_verify_locations(cafile=https[2])
            uv_config.ssl.verify_mode = ssl.CERT_OPTIONAL
            log.info("/k8s/* takes a client certificate signed by %s (sched.k8s_client_ca_file)", https[2])
    server = uvicorn.Server(uv_config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # ours below
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await service.start()
    failed: list[BaseException] = []

    async def api() -> None:
        sync_stop = asyncio.Event()
        # With a binder, PodSync keeps the core's books equal to the API server's pods (ended pods free
        # their GPUs at once, so no hold needs to run out; pods bound while dlshare was down are taken in).
        sync = asyncio.create_task(PodSync(service, binder).run(sync_stop)) if binder is not None else None
        renew = (asyncio.create_task(_reload_tls(tls.CertFiles(uv_config.ssl, https[0], https[1]),
                                                 float(s["tls_reload_s"])))
                 if https is not None and s["tls_reload_s"] > 0 else None)
        try:
            await server.serve()
        finally:
            if renew is not None:
                renew.cancel()
                await asyncio.gather(renew, return_exceptions=True)
            if sync is not None:  # stopped, not awaited through a list or a call still in flight
                sync_stop.set()
                sync.cancel()
                await asyncio.gather(sync, return_exceptions=True)
            if binder is not None:
                await binder.aclose()  # its connections belong to the API's loop

    if s["api_thread"]:
        def run_api() -> None:
            try:
                asyncio.run(api())
            except BaseException as exc:  # noqa: BLE001 - reported to the main thread
                failed.append(exc)

        thread = threading.Thread(target=run_api, name="sched-api", daemon=True)
        thread.start()
        done = lambda: not thread.is_alive()  # noqa: E731
    else:
        task = asyncio.create_task(api())
        done = task.done
    while not server.started and not done():
        await asyncio.sleep(0.02)
    if not server.started:
        await service.stop()
        store.close()
        if not s["api_thread"]:
            task.result()
        raise RuntimeError(f"scheduler API could not listen on {host}:{port}"
                           + (f": {failed[0]}" if failed else ""))
    log.info("scheduler service on %s://%s:%d (profile %s, db %s, broker %s, API on %s)", "https" if https else "http",
             host, port, service.profile, s["db"], broker, "its own thread" if s["api_thread"] else "the loop")
    if ready:
        ready.set()
    await stop.wait()
    server.should_exit = True
    if s["api_thread"]:
        await asyncio.to_thread(thread.join, 30)
    else:
        await task
    await service.stop()
    store.close()


async def _reload_tls(files, period_s: float) -> None:
    """Every ``period_s``, a renewed certificate and key go into the API's TLS context (on the API's
    own loop, which runs its handshakes); a pair that does not load is logged and the old one kept."""
    while True:
        await asyncio.sleep(period_s)
        try:
            if files.reload_if_changed():
                log.info("HTTPS: loaded the renewed certificate %s", files.cert_file)
        except Exception as exc:  # noqa: BLE001 - a renewal that fails must not end the renewals
            log.error("HTTPS: %s; still serving the certificate loaded before", exc)


def _run_sched(args, cfg) -> int:
    asyncio.run(serve(cfg))
    return 0


def register(cli) -> None:
    p = cli.add("sched", _run_sched, "run the scheduler service: job API, live loop, Kubernetes extender",
                sections=["sched"])
    cli.config_flag(p, "--listen", "sched", "listen", help="HOST:PORT of the HTTP API (default 127.0.0.1:7800)")
    cli.config_flag(p, "--db", "sched", "db", help="SQLite database path")
    cli.config_flag(p, "--token", "sched", "token", help="bearer token (default: generated, stored in <db>.token)")
    cli.config_flag(p, "--profile", "sched", "profile", help="scheduling profile (scheduler/profiles/NAME.toml)")
    cli.config_flag(p, "--broker", "dlshare", "broker", help="MQTT broker URL")
    cli.config_flag(p, "--tls-cert-file", "sched", "tls_cert_file", help="serve HTTPS with this certificate (PEM)")
    cli.config_flag(p, "--tls-key-file", "sched", "tls_key_file", help="... and this private key (PEM)")
    cli.config_flag(p, "--k8s-client-ca-file", "sched", "k8s_client_ca_file",
                    help="with HTTPS: client certificates signed by this CA may call /k8s/* (kube-scheduler's)")

    from scheduler.cli import jobs  # dlshare job, dlshare token: the API's client commands

    jobs.register(cli)


__all__ = ["register", "serve"]
