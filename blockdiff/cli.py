"""The ``blockdiff`` command: a thin front door that parses options and calls the library.

Exit codes: 0 no divergence, 1 divergence found, 2 usage or input error (one line on
stderr; the traceback only with ``--debug``), 130 interrupted.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable

import click
from rich.console import Console

from .errors import BlockdiffError

EXIT_DIVERGED = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

_state = {"debug": bool(os.environ.get("BLOCKDIFF_DEBUG"))}


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        _state["debug"] = True
    return value


def debug_option(fn: Callable) -> Callable:
    return click.option(
        "--debug",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_set_debug,
        help="Show the full traceback on errors.",
    )(fn)


def _fail(message: str, exc: BaseException | None = None) -> None:
    if _state["debug"] and exc is not None:
        traceback.print_exception(exc)
    click.echo(f"Error: {message}", err=True)
    sys.exit(EXIT_ERROR)


def _console() -> Console:
    """Rich console for stdout; wide enough for the tables when stdout is not a terminal."""
    return Console() if sys.stdout.isatty() else Console(width=120)


def _parse_tolerances(values: tuple[str, ...]) -> dict[str, float]:
    overrides: dict[str, float] = {}
    for item in values:
        name, sep, number = item.partition("=")
        try:
            if not sep:
                raise ValueError
            overrides[name.strip()] = float(number)
        except ValueError:
            raise click.BadParameter(f"expected SUBPATH=VALUE (e.g. ffn=0.05), found {item!r}", param_hint="--tol") from None
    return overrides


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="blockdiff")
@debug_option
def cli() -> None:
    """blockdiff: where do two implementations of a transformer first diverge, and is it a
    bug or precision?

    \b
    Examples:
      blockdiff diff samples/tinylm.py:build samples/bugs.py:gelu_for_silu
      blockdiff diff samples/tinylm.py:build --cand-dtype bfloat16
      blockdiff arch samples/tinylm.py:build
    """


model_options = [
    click.option("--batch", type=int, default=2, show_default=True, help="Batch size of the random token ids."),
    click.option("--seq", type=int, default=16, show_default=True, help="Sequence length of the random token ids."),
    click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random token ids."),
    click.option(
        "--tokens",
        type=click.Path(dir_okay=False),
        help="Token ids from a .json list of lists or a .safetensors file with input_ids (overrides --batch/--seq/--seed).",
    ),
]


def _apply(options: list) -> Callable:
    def decorate(fn: Callable) -> Callable:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


@cli.command("diff")
@click.argument("reference")
@click.argument("candidate", required=False)
@click.option("--ref-device", default="cpu", show_default=True, help="Device of the reference (cpu, cuda, cuda:N, auto).")
@click.option("--ref-dtype", default="float32", show_default=True, help="Dtype of the reference.")
@click.option("--cand-device", default=None, help="Device of the candidate [default: the reference's].")
@click.option("--cand-dtype", default=None, help="Dtype of the candidate [default: the reference's].")
@_apply(model_options)
@click.option("--hooks", "hooks_path", type=click.Path(dir_okay=False), help="Hook map TOML for both sides (default: found by class name).")
@click.option("--ref-hooks", type=click.Path(dir_okay=False), help="Hook map TOML for the reference only.")
@click.option("--cand-hooks", type=click.Path(dir_okay=False), help="Hook map TOML for the candidate only.")
@click.option(
    "--tolerance",
    "policy",
    type=click.Choice(["fixed", "calibrated"]),
    default=None,
    help="Tolerance policy [default: calibrated when dtypes or devices differ, else fixed].",
)
@click.option("--tol", "tols", multiple=True, metavar="SUBPATH=VALUE", help="Fixed rel-L2 threshold for one sub-path or stage; repeatable.")
@click.option(
    "--capacity-factor",
    "capacity_factors",
    type=float,
    multiple=True,
    help="Counterfactual capacity factor for the routing statistics of dropless MoE blocks; repeatable [default: 1.0 and 1.25].",
)
@click.option("--fast/--no-fast", default=False, show_default=True, help="Skip sub-path experiments of blocks that are within tolerance as a whole.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the JSON report (blockdiff.report/1) here.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the first-divergence line.")
@debug_option
def diff_command(
    reference: str,
    candidate: str | None,
    ref_device: str,
    ref_dtype: str,
    cand_device: str | None,
    cand_dtype: str | None,
    batch: int,
    seq: int,
    seed: int,
    tokens: str | None,
    hooks_path: str | None,
    ref_hooks: str | None,
    cand_hooks: str | None,
    policy: str | None,
    tols: tuple[str, ...],
    capacity_factors: tuple[float, ...],
    fast: bool,
    json_path: str | None,
    quiet: bool,
) -> None:
    """Diff CANDIDATE against REFERENCE and localize the first divergence.

    A model is path/to/file.py:factory or package.module:factory (a callable returning
    an nn.Module). CANDIDATE defaults to REFERENCE's factory, so --cand-dtype alone
    compares precisions. Exit code 0: no divergence; 1: divergence; 2: usage or input error.

    \b
    Examples:
      blockdiff diff samples/tinylm.py:build samples/bugs.py:residual_dropped
      blockdiff diff samples/tinylm.py:build --cand-dtype bfloat16 --json report.json
      blockdiff diff mypkg.models:reference mypkg.models:fused --tol ffn=0.02
      blockdiff diff samples/tinylm.py:build --ref-device cpu --cand-device cuda --cand-dtype bfloat16
      blockdiff diff samples/tinylm.py:build_moe samples/bugs.py:moe_expert_off_by_one --capacity-factor 1.5
    """
    from . import hookmap
    from .engine import diff
    from .inputs import load_tokens, random_tokens
    from .loading import build_model, parse_device, parse_dtype
    from .render import render
    from .tolerance import Tolerance

    overrides = _parse_tolerances(tols)
    if any(not cf > 0 for cf in capacity_factors):
        raise click.BadParameter("capacity factors must be positive numbers", param_hint="--capacity-factor")
    if hooks_path and (ref_hooks or cand_hooks):
        raise click.UsageError("--hooks applies to both sides; do not combine it with --ref-hooks/--cand-hooks")
    r_device, r_dtype = parse_device(ref_device), parse_dtype(ref_dtype)
    c_device = parse_device(cand_device) if cand_device else r_device
    c_dtype = parse_dtype(cand_dtype) if cand_dtype else r_dtype
    tolerance = Tolerance(policy=policy, overrides=overrides)
    r_map = hookmap.load(ref_hooks or hooks_path) if (ref_hooks or hooks_path) else None
    c_map = hookmap.load(cand_hooks or hooks_path) if (cand_hooks or hooks_path) else None
    candidate = candidate or reference
    ref_model = build_model(reference, device=r_device, dtype=r_dtype)
    cand_model = build_model(candidate, device=c_device, dtype=c_dtype)
    if tokens:
        ids = load_tokens(tokens)
    else:
        from .engine import vocab_size

        vocab = vocab_size(ref_model, hookmap.resolve(ref_model, r_map))
        if vocab is None:
            raise BlockdiffError("cannot tell the reference's vocabulary size; give token ids with --tokens")
        ids = random_tokens(batch=batch, seq=seq, vocab=vocab, seed=seed)
    report = diff(
        ref_model,
        cand_model,
        ids,
        tolerance=tolerance,
        reference_hooks=r_map,
        candidate_hooks=c_map,
        fast_path=fast,
        capacity_factors=capacity_factors or (1.0, 1.25),
        labels=(reference, candidate),
    )
    if json_path:
        try:
            report.write_json(json_path)
        except OSError as exc:
            raise BlockdiffError(f"cannot write the JSON report to {json_path}: {exc.strerror or exc}") from None
    if quiet:
        first = report.first_divergence
        click.echo("no divergence" if first is None else f"first divergence: {first.headline()}")
    else:
        render(report, _console())
    sys.exit(EXIT_DIVERGED if report.diverged else 0)


@cli.command("arch")
@click.argument("model")
@click.option("--hooks", "hooks_path", type=click.Path(dir_okay=False), help="Hook map TOML to apply instead of the bundled one.")
@click.option("--json", "as_json", is_flag=True, help="Print the resolved layout as JSON.")
@debug_option
def arch_command(model: str, hooks_path: str | None, as_json: bool) -> None:
    """Print how MODEL's modules map to stages and sub-paths.

    Check this before trusting a diff: every block should list its attention, ffn and
    norm modules, and the embedding, final norm and head should be named.

    \b
    Examples:
      blockdiff arch samples/tinylm.py:build
      blockdiff arch mypkg.models:build --hooks my_map.toml --json
    """
    import json

    import torch

    from . import hookmap
    from .loading import build_model
    from .render import render_layout

    built = build_model(model, device=torch.device("cpu"), dtype=torch.float32)
    layout = hookmap.resolve(built, hookmap.load(hooks_path) if hooks_path else None)
    if as_json:
        click.echo(json.dumps(layout.to_dict(), indent=2))
    else:
        render_layout(layout, model, _console())


def main(argv: list[str] | None = None) -> Any:
    """Entry point of the console script."""
    try:
        return cli.main(args=argv, prog_name="blockdiff", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "blockdiff"
        _fail(f"{exc.format_message()} Try '{where} --help'.", exc)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc)
    except BlockdiffError as exc:
        _fail(str(exc), exc)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":  # pragma: no cover
    main()
