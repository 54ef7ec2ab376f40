"""Running and setting up a node: `ferry agent`, `certs` and `doctor`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from agent import config
from agent.cli.output import print_json
from agent.cli.parser import EXIT_ERROR, EXIT_OK, Usage
from agent.errors import FerryError


def cmd_agent(args: argparse.Namespace) -> int:
    from agent.service.serve import serve

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from agent import tls
    from agent.certs import Role

    staging = args.staging_dir or config.DEFAULT_STAGING_ROOT / args.node_name
    identity = None
    if args.insecure and args.tls_dir:
        raise Usage("ferry agent: --insecure serves plaintext and --tls-dir TLS; give one of them")
    if not args.insecure:
        try:
            identity = tls.load(args.tls_dir or tls.default_dir(), args.node_name, Role.NODE)
        except FerryError as e:
            e.hint = (
                f"issue one with `ferry certs node {args.node_name} --host HOST --dir DIR` and pass "
                "--tls-dir DIR; or serve plaintext on loopback with --insecure"
            )
            raise
    args.state_dir.mkdir(parents=True, exist_ok=True)
    from agent import agent_config

    settings = agent_config.load(args.config)
    socket_path = None if args.socket == "none" else Path(args.socket)
    serve(
        args.listen,
        args.state_dir.resolve(),
        args.node_name,
        staging,
        args.insecure,
        identity,
        socket_path,
        settings,
        metrics_listen=args.metrics_listen,
    )
    return EXIT_OK


def cmd_certs(args: argparse.Namespace) -> int:
    from agent import certs

    if args.certs_cmd == "ca":
        out = certs.create_ca(args.dir)
    else:
        role = certs.Role.NODE if args.certs_cmd == "node" else certs.Role.CLIENT
        out = certs.issue(args.dir, args.name, role, getattr(args, "host", []))
    if args.json:
        print_json(
            {
                "cert": str(out.cert),
                "key": str(out.key),
                "subject": out.subject,
                "not_after": out.not_after.isoformat(),
            }
        )
    else:
        print(f"{out.cert} and {out.key} ({out.subject}, valid until {out.not_after:%Y-%m-%d})")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from agent import agent_config
    from agent.cli.doctor import can_migrate, deep_checks, run_checks

    if not 0 < args.share <= 0.9:
        raise Usage(f"ferry doctor: --share {args.share:g}: expected above 0 and at most 0.9")
    cfg = agent_config.load(args.config)
    checks = run_checks(args.staging_dir, cfg.network, cfg.coordination)
    if args.deep:
        checks += deep_checks(args.share)
    ok = can_migrate(checks)
    if args.json:
        print_json({"can_migrate": ok, "checks": [c.__dict__ for c in checks]})
    else:
        for c in checks:
            mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
            fix = f"  -> {c.fix}" if not c.ok and c.fix else ""
            print(f"[{mark}] {c.name}: {c.detail}{fix}")
        print("this host can migrate jobs" if ok else "this host cannot migrate jobs yet (see FAIL above)")
    return EXIT_OK if ok else EXIT_ERROR
