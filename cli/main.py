"""vtoken-cli: validate, list, compile, bench and eval eviction policies.

Results go to stdout (rich tables or ``--json``), diagnostics to stderr.
Exit codes: 0 success, 1 a check or definition failed, 2 usage error.
"""

from __future__ import annotations

import typer

from .validate_cmd import list_policies, validate

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="vtoken: KV-cache eviction policies that free real memory.")
app.command("validate")(validate)
app.command("list")(list_policies)


from .bench_cmd import bench_app  # noqa: E402
from .compile_cmd import compile_policies  # noqa: E402
from .eval_cmd import evaluate  # noqa: E402
from .eval_niah_cmd import eval_niah  # noqa: E402
from .eval_ruler_cmd import eval_ruler  # noqa: E402
from .eval_ruler_serve_cmd import eval_ruler_serve  # noqa: E402
from .serve_cmd import serve_server  # noqa: E402

app.add_typer(bench_app, name="bench")
# `vtoken-cli eval` alone is the perplexity/passkey evaluation; `eval ruler` and `eval niah` are its subcommands.
eval_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
eval_app.callback(invoke_without_command=True)(evaluate)
eval_app.command("ruler")(eval_ruler)
eval_app.command("ruler-serve")(eval_ruler_serve)
eval_app.command("niah")(eval_niah)
app.add_typer(eval_app, name="eval")
app.command("compile")(compile_policies)
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve_server)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
