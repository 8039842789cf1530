"""The ``blockdiff`` command: a thin front door that parses options and calls the library.

Exit codes: 0 no divergence (and ``blockdiff`` alone, which prints the help), 1 divergence
found, 2 usage or input error (one line on stderr, and for a usage error a second line
naming the ``--help`` to read; the traceback only with ``--debug``), 3 an internal error of
blockdiff (one line naming the file that holds the traceback), 130 interrupted.

Stdout carries what a command shows (a report, a dump's summary, a layout) and nothing
else; the files a command wrote or replaced (``capture``'s dump, ``export``'s file, a
diff's ``--json``, ``--plot``, ``--html``, ``--save-dumps``) are named on stderr, one line
each (not with ``-q``). Piped, stdout is ``COLUMNS`` wide, else 80, its lines without
trailing spaces; ``--help`` and usage errors are answered before torch is imported.
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from typing import Any, Callable

import click
from rich.console import Console

from .errors import BlockdiffError, ModelRunError, ModelSpecError, OptionsError

# How the CLI spells the library's options (Options' fields, capture's keywords) in the
# errors it prints (OptionsError).
FLAGS = {
    "backward": "--backward", "baseline_dtype": "--baseline-dtype", "caches": "--ref-cache/--cand-cache",
    "capacity_factors": "--capacity-factor", "decode": "--decode", "fast_path": "--fast", "floors": "--floors",
    "loss": "--loss", "max_memory": "--max-memory", "rank": "--rank", "save_dumps": "--save-dumps", "stream": "--stream", "tolerance": "--tolerance",
}

EXIT_DIVERGED = 1
EXIT_ERROR = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130

_state = {"debug": bool(os.environ.get("BLOCKDIFF_DEBUG"))}
# click >= 8.2 raises this for a group called without a command (older ones print the help
# and exit 0 themselves).
_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())


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


def _fail(message: str, exc: BaseException | None = None, *, hint: str | None = None) -> None:
    """``Error: message`` on stderr, ``hint`` (what to read) on a line of its own; exit 2.
    An error raised by the user's code (a factory, an import, a model's forward) says
    where its traceback is to be had."""
    if _state["debug"] and exc is not None:
        traceback.print_exception(exc)
    user_code = isinstance(exc, (ModelSpecError, ModelRunError)) and isinstance(exc.__cause__, Exception)
    if user_code and not _state["debug"] and not isinstance(exc.__cause__, BlockdiffError):
        message += " (add --debug for the traceback)"
    if not _announced(message):
        sys.exit(EXIT_ERROR)
    click.echo(f"Error: {_ranked(message)}", file=_errors())
    if hint:
        click.echo(hint, file=_errors())
    sys.exit(EXIT_ERROR)


def _errors() -> Any:
    """Where errors go: stderr (a rank of a launched run other than 0 keeps it for its
    errors alone)."""
    return _state.get("stderr") or sys.stderr


def _ranked(message: str) -> str:
    """``message`` naming this process's rank, in a launched run."""
    watch = _state.get("watch")
    return message if watch is None else f"rank {watch.rank}: {message}"


def _announced(message: str) -> bool:
    """In a launched run: tell every rank that this one failed (``message`` is then said
    with the rank's number, by this rank alone). ``False`` when another rank failed first
    and this one only followed it: it says nothing. ``True`` outside a launched run."""
    watch = _state.get("watch")
    if watch is None:
        return True
    return watch.failed(message) == f"rank {watch.rank}: {message}"


def _said(message: str) -> None:
    """A line about what was done (a file written or replaced): stderr, so that stdout
    keeps the report alone."""
    click.echo(message, err=True)


def _console() -> Console:
    """Rich console for stdout: the width ``COLUMNS`` names, else the terminal's, else 80
    (a pipe, a file); its lines without trailing spaces."""
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) > 0 else None if sys.stdout.isatty() else 80
    return Console(file=_Trimmed(sys.stdout), width=width)


class _Trimmed:
    """A text stream that writes each line without its trailing spaces (rich pads a
    table's cells and wrapped text out to the console's width). A line not yet ended is
    held until its end, or written as it is when the stream is flushed."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self._stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the stream's
        return getattr(self._stream, name)


def _size_option(value: str | None, param: click.Parameter) -> int | None:
    """``--max-memory``'s bytes."""
    if value is None:
        return None
    from .diskweights import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _parse_tolerances(values: tuple[str, ...]) -> dict[str, float]:
    from .errors import InputError
    from .tolerance import Tolerance

    try:
        return dict(Tolerance.parse_override(item) for item in values)
    except InputError as exc:
        raise click.BadParameter(str(exc), param_hint="--tol") from None


class _Running(click.Command):
    """A command that runs models: its progress bar is up while it runs, once its
    arguments are parsed (``--help`` and usage errors import nothing of torch)."""

    def invoke(self, ctx: click.Context) -> Any:
        with _progress_bar():
            return super().invoke(ctx)


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
      blockdiff capture samples/tinylm.py:build --out ref.h5
      blockdiff diff ref.h5 samples/bugs.py:gelu_for_silu
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
    click.option(
        "--inputs",
        "inputs_path",
        type=click.Path(dir_okay=False),
        help="Named inputs passed as keyword arguments (input_ids, attention_mask, decoder_input_ids, pixel_values, ...): "
        "every tensor of a .safetensors file, or a .json object of arrays.",
    ),
]


def _inputs_spec(tokens: str | None, inputs_path: str | None, batch: int, seq: int, seed: int):
    from .inputs import InputsFile, RandomTokens

    if tokens and inputs_path:
        raise click.UsageError("give --tokens or --inputs, not both")
    if inputs_path:
        return InputsFile(inputs_path)
    return tokens or RandomTokens(batch=batch, seq=seq, seed=seed)


def _apply(options: list) -> Callable:
    def decorate(fn: Callable) -> Callable:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate



def _decode_option(help_text: str) -> Callable:
    """``--decode N``, as ``diff`` and ``capture`` take it."""
    return click.option("--decode", type=click.IntRange(min=1), default=None, metavar="N", help=help_text)

@cli.command("diff", cls=_Running, short_help="Localize the first divergence of CANDIDATE from REFERENCE.")
@click.argument("reference")
@click.argument("candidate", required=False)
@click.option("--ref-device", default="cpu", show_default=True, help="Device of the reference (cpu, cuda, cuda:N, auto).")
@click.option("--ref-dtype", default=None,
              help="Dtype of the reference [default: a checkpoint directory's own, else float32].")
@click.option("--cand-device", default=None, help="Device of the candidate [default: the reference's].")
@click.option("--cand-dtype", default=None,
              help="Dtype of the candidate [default: a checkpoint directory's own, else the reference's].")
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
@click.option("--tol", "tols", multiple=True, metavar="SUBPATH=VALUE", help="Fixed rel-L2 threshold for one sub-path or stage (or drift, the free-running candidate); repeatable.")
@click.option(
    "--capacity-factor",
    "capacity_factors",
    type=float,
    multiple=True,
    help="Counterfactual capacity factor for the routing statistics of dropless MoE blocks; repeatable [default: 1.0 and 1.25].",
)
@click.option("--fast/--no-fast", default=False, show_default=True, help="Skip sub-path experiments of blocks that are within tolerance as a whole.")
@click.option(
    "--rank",
    "rank",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Also rank every check (and every module's children) by local error over a baseline, and print the worst N; "
    "the JSON keeps them all under `ranking`. The exit code still follows the verdict.",
)
@click.option(
    "--baseline-dtype",
    default=None,
    metavar="DTYPE",
    help="With --rank: the baseline is the reference's own floor at this precision (is an int8 candidate worse "
    "than bfloat16 here?) [default: each check's threshold].",
)
@_decode_option(
    "After the prompt (the inputs), N decode steps of one token, each side with its own KV cache, every "
    "step localized (docs/decode.md). With no CANDIDATE: the model's cached decode against its own uncached "
    "forward; with a dump of a decode as REFERENCE: its steps (all, unless N is given)."
)
@click.option("--ref-cache", type=click.Choice(["dynamic", "static"]), default="dynamic", show_default=True,
              help="With --decode: the reference's Hugging Face cache.")
@click.option("--cand-cache", type=click.Choice(["dynamic", "static"]), default=None,
              help="With --decode: the candidate's Hugging Face cache [default: --ref-cache].")
@click.option("--backward", is_flag=True,
              help="Also run forward and backward on both sides (same inputs, same loss, eval mode) and localize the "
              "first divergent gradient, from the head to the embedding; the forward and backward verdicts are "
              "reported apart (docs/backward.md).")
@click.option("--loss", "loss", metavar="MODULE:FUNCTION", default=None,
              help="With --backward: the loss, a function (output, inputs) -> scalar in path/to/file.py or "
              "package.module [default: next-token cross-entropy on the input ids].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the JSON report (blockdiff.report/2) here.")
@click.option("--save-dumps", type=click.Path(file_okay=False), help="Keep both sides' captures as DIR/reference.h5 and DIR/candidate.h5 (implies --stream).")
@click.option("--stream", is_flag=True, help="Capture to temporary dumps and localize block by block: memory holds one block's activations.")
@click.option("--max-memory", "max_memory", metavar="SIZE", callback=lambda ctx, param, value: _size_option(value, param),
              help="Read each model's weights from its checkpoint a block at a time, holding at most SIZE of them (e.g. 2GiB; implies --stream).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG: local-error heatmap, drift, MoE expert loads (needs matplotlib).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write one self-contained HTML report (the JSON embedded).")
@click.option("--quiet", "-q", is_flag=True, help="Print only the first-divergence line.")
@debug_option
def diff_command(
    reference: str,
    candidate: str | None,
    ref_device: str,
    ref_dtype: str | None,
    cand_device: str | None,
    cand_dtype: str | None,
    batch: int,
    seq: int,
    seed: int,
    tokens: str | None,
    inputs_path: str | None,
    hooks_path: str | None,
    ref_hooks: str | None,
    cand_hooks: str | None,
    policy: str | None,
    tols: tuple[str, ...],
    capacity_factors: tuple[float, ...],
    fast: bool,
    rank: int | None,
    baseline_dtype: str | None,
    decode: int | None,
    ref_cache: str,
    cand_cache: str | None,
    backward: bool,
    loss: str | None,
    json_path: str | None,
    save_dumps: str | None,
    stream: bool,
    max_memory: int | None,
    plot_path: str | None,
    html_path: str | None,
    quiet: bool,
) -> None:
    """Diff CANDIDATE against REFERENCE and localize the first divergence.

    A model is path/to/file.py:factory or package.module:factory (a callable returning
    an nn.Module), a local Hugging Face model directory or config.json, or an HDF5 dump
    written by `blockdiff capture`. CANDIDATE defaults to REFERENCE's factory, so
    --cand-dtype alone compares precisions.

    \b
    REFERENCE  CANDIDATE  what runs
    model      model      live diff with full localization
    dump       model      replay: the candidate runs on the dump's inputs,
                          localized against the stored reference block by block
    dump       dump       offline: drift at every site only
    model      .onnx      ONNX Runtime candidate, localized with sub-graph
                          experiments (a graph exported by torch.onnx.export(...,
                          dynamo=True) on inputs shaped like --batch/--seq;
                          docs/runtimes.md)
    model      .gguf      llama.cpp candidate, localized by runs with the
                          reference's values substituted site by site
                          (pip install "blockdiff[llamacpp]"); an MLX model
                          from a factory likewise ("blockdiff[mlx]")

    A sharded CANDIDATE (tensor, sequence, expert or pipeline parallel) runs under a
    launcher: every rank runs blockdiff, rank 0 reports (docs/sharded.md).

    Exit code 0: no divergence; 1: divergence; 2: usage or input error, or an
    error raised by the models' code; 3: an internal error of blockdiff (the line
    names the file holding the traceback). The report goes to stdout; the files
    written are named on stderr.

    \b
    Examples:
      blockdiff diff samples/tinylm.py:build samples/bugs.py:residual_dropped
      blockdiff diff samples/tinylm.py:build --cand-dtype bfloat16 --json r.json
      blockdiff diff mypkg.models:reference mypkg.models:fused --tol ffn=0.02
      blockdiff diff samples/tinylm.py:build --cand-device cuda \\
        --cand-dtype bfloat16
      blockdiff diff samples/tinylm.py:build_moe \\
        samples/bugs.py:moe_expert_off_by_one --capacity-factor 1.5
      blockdiff diff ref.h5 samples/bugs.py:gelu_for_silu --cand-dtype bfloat16
      blockdiff diff ref.h5 cand.h5
      blockdiff diff samples/hf_llama.py:build \\
          samples/decode_bugs.py:cache_one_slot_early --decode 4
      blockdiff diff samples/hf_llama.py:build --decode 8
      blockdiff diff samples/tinylm.py:build \\
          samples/backward_bugs.py:fused_norm_weight_grad --backward
      blockdiff diff samples/tinylm.py:build tinylm.onnx --batch 2 --seq 16
      blockdiff diff ref_dir cand_dir --max-memory 1GiB --cand-dtype bfloat16
      blockdiff diff hf_model_dir model-q8_0.gguf --rank 10
      blockdiff diff samples/runtimes.py:reference \\
          samples/runtimes.py:mlx_attention_scale
      blockdiff diff samples/tinylm.py:build samples/bugs.py:post_norm \\
        --plot bug.png --html bug.html
      torchrun --nproc-per-node 2 -m blockdiff diff \\
        samples/hf_llama.py:build samples/sharded.py:llama_tp
    """
    from . import engine, hookmap
    from .dtypes import parse_dtype
    from .loading import parse_device
    from .tolerance import Tolerance

    overrides = _parse_tolerances(tols)
    if plot_path:
        from .plot import require_matplotlib

        require_matplotlib()  # fail before the diff runs, not after
    if any(not cf > 0 for cf in capacity_factors):
        raise click.BadParameter("capacity factors must be positive numbers", param_hint="--capacity-factor")
    if hooks_path and (ref_hooks or cand_hooks):
        raise click.UsageError("--hooks applies to both sides; do not combine it with --ref-hooks/--cand-hooks")
    r_device = parse_device(ref_device)
    c_device = parse_device(cand_device) if cand_device else r_device
    # Not asked: a checkpoint directory runs in its own dtype (engine.run, loading.side_dtypes).
    r_dtype, c_dtype = (parse_dtype(ref_dtype) if ref_dtype else None), (parse_dtype(cand_dtype) if cand_dtype else None)

    # --save-dumps writes these two; the ones there already are replaced, and said so.
    kept = [os.path.join(save_dumps, f"{name}.h5") for name in ("reference", "candidate")] if save_dumps else []
    replaced = {path for path in kept if os.path.exists(path)}
    report = engine.run(
        reference,
        candidate,
        _inputs_spec(tokens, inputs_path, batch, seq, seed),
        options=engine.Options(
            tolerance=Tolerance(policy=policy, overrides=overrides),
            reference_hooks=hookmap.load(ref_hooks or hooks_path) if (ref_hooks or hooks_path) else None,
            candidate_hooks=hookmap.load(cand_hooks or hooks_path) if (cand_hooks or hooks_path) else None,
            fast_path=fast,
            capacity_factors=capacity_factors or (1.0, 1.25),
            labels=(reference, candidate or reference),
            save_dumps=save_dumps,
            stream=stream,
            rank=rank is not None,
            baseline_dtype=parse_dtype(baseline_dtype) if baseline_dtype else None,
            devices=(r_device, c_device),
            dtypes=(r_dtype, c_dtype),
            decode=decode or 0,
            caches=(ref_cache, cand_cache or ref_cache),
            backward=backward,
            loss=loss,
            max_memory=max_memory,
        ),
    )
    _stop_progress()
    if save_dumps and not quiet:
        for path in kept:
            _said(f"{'replaced' if path in replaced else 'wrote'} {path}")
    _emit(report, json_path=json_path, quiet=quiet, plot_path=plot_path, html_path=html_path, rank=rank)


def _write(what: str, path: str, write: Callable[[], None], *, quiet: bool = False) -> None:
    """``write()`` the ``what`` to ``path``, then say so on stderr (unless ``quiet``)."""
    try:
        write()
    except OSError as exc:
        raise BlockdiffError(f"cannot write the {what} to {path}: {exc.strerror or exc}") from None
    if not quiet:
        _said(f"wrote {path} ({what})")


def _pictures(report: Any, *, plot_path: str | None, html_path: str | None, quiet: bool = False) -> None:
    if plot_path:
        from .plot import write_png

        _write("PNG", plot_path, lambda: write_png(report, plot_path), quiet=quiet)
    if html_path:
        from .html import write_html

        _write("HTML report", html_path, lambda: write_html(report, html_path), quiet=quiet)


def _advice(*, json_path: str | None) -> str:
    """The report's closing line, for what this run did not write already."""
    from .render import ADVICE, ADVICE_JSON_WRITTEN

    return ADVICE if json_path is None else ADVICE_JSON_WRITTEN.format(path=json_path)


def _emit(
    report, *, json_path: str | None, quiet: bool, plot_path: str | None = None, html_path: str | None = None, rank: int | None = None
) -> None:
    """Write the JSON report and pictures (each said on stderr, but with ``quiet``), print
    the report (and the worst ``rank`` of its ranking), exit 1 on divergence."""
    from . import distributed
    from .render import render, render_ranking

    if distributed.rank() != 0:  # rank 0 speaks for every rank of a launched run
        sys.exit(EXIT_DIVERGED if report.diverged else 0)
    if json_path:
        _write("JSON report", json_path, lambda: report.write_json(json_path), quiet=quiet)
    _pictures(report, plot_path=plot_path, html_path=html_path, quiet=quiet)
    if quiet:
        first = report.first_divergence
        if report.backward is not None:  # --backward: both verdicts, apart
            click.echo(report.verdict())
        else:
            click.echo("no divergence" if first is None else f"first divergence: {first.headline()}")
    else:
        render(report, _console(), advice=_advice(json_path=json_path))
    if rank is not None and report.ranking is not None:
        render_ranking(report, _console(), top=rank)
    sys.exit(EXIT_DIVERGED if report.diverged else 0)


@cli.command("report", short_help="Show a saved JSON report, or write it as a PNG or HTML.")
@click.argument("report_path", metavar="REPORT.json")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the PNG (needs matplotlib).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write the self-contained HTML report.")
@debug_option
def report_command(report_path: str, plot_path: str | None, html_path: str | None) -> None:
    """Show a saved JSON report (from `blockdiff diff --json`) in the terminal, or write it
    as a PNG and/or HTML.

    \b
    Examples:
      blockdiff report report.json
      blockdiff report report.json --plot report.png --html report.html
    """
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(report_path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BlockdiffError(f"{report_path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockdiffError(f"{report_path}: not a JSON report ({exc})") from None
    if not plot_path and not html_path:
        from .render import ADVICE_SAVED, render

        render(data, _console(), advice=ADVICE_SAVED.format(path=report_path))
        return
    if plot_path:
        from .plot import require_matplotlib

        require_matplotlib()
    _pictures(data, plot_path=plot_path, html_path=html_path)


@cli.command("invariance", cls=_Running, short_help="Find where a row of a batch differs from the row alone.")
@click.argument("model")
@click.option("--batch", type=click.IntRange(min=2), default=8, show_default=True, help="Rows in the batch (random token ids).")
@click.option("--seq", type=click.IntRange(min=1), default=16, show_default=True, help="Tokens per row (random token ids).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random token ids.")
@click.option("--tokens", type=click.Path(dir_okay=False), help="The batch's token ids (.json list of lists or .safetensors), instead of random ones.")
@click.option("--rows", default=None, metavar="I,J,...", help="The rows judged, each alone against itself in the batch [default: all].")
@click.option("--padding", type=click.Choice(["left", "right"]), default=None,
              help="Rows of different lengths (--lengths; default: the first row whole, the last half), padded on this side, "
              "with the attention mask and position ids.")
@click.option("--lengths", default=None, metavar="N,N,...", help="With --padding: each row's number of tokens.")
@click.option("--tol", "bound", type=float, default=0.0, show_default=True, help="The relative L2 a row may differ by (0: bit-exact).")
@click.option("--device", default="cpu", show_default=True, help="Device to run on (cpu, cuda, cuda:N, auto).")
@click.option("--dtype", default=None, help="Dtype to run in [default: a checkpoint directory's own, else float32].")
@click.option("--hooks", "hooks_path", type=click.Path(dir_okay=False), help="Hook map TOML (default: found by class name).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the JSON report (blockdiff.report/2) here.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write one self-contained HTML report (the JSON embedded).")
@click.option("--quiet", "-q", is_flag=True, help="Print only the first-divergence line.")
@debug_option
def invariance_command(
    model: str, batch: int, seq: int, seed: int, tokens: str | None, rows: str | None, padding: str | None,
    lengths: str | None, bound: float, device: str, dtype: str, hooks_path: str | None, json_path: str | None,
    html_path: str | None, quiet: bool,
) -> None:
    """Find the first operation of MODEL whose output for a row depends on the rest of
    its batch.

    Each row runs alone (the reference) and inside the batch (the candidate); every site
    is compared row by row, bit for bit unless --tol is given, and each experiment runs
    the whole batch with the row's inputs the row alone's, so the first divergence names a
    block, a sub-path and, through the drill-down, the child module (docs/invariance.md).
    Exit status 1 when a row differs.

    \b
    Examples:
      blockdiff invariance samples/tinylm.py:build
      blockdiff invariance samples/invariance_bugs.py:matmul_split_by_rows \\
        --batch 4
      blockdiff invariance samples/hf_llama.py:build --batch 4 --seq 12 \\
        --padding left
      blockdiff invariance mypkg.models:build --dtype bfloat16 --batch 32 \\
        --tol 1e-3
    """
    from . import hookmap
    from .dtypes import parse_dtype
    from .modes.invariance import invariance
    from .loading import parse_device

    if lengths and not padding:
        raise click.UsageError("--lengths gives rows of different lengths: give --padding left or right too")
    report = invariance(
        model, tokens, batch=batch, seq=seq, seed=seed, rows=_numbers(rows, "--rows"), padding=padding,
        lengths=_numbers(lengths, "--lengths"), tolerance=bound, hooks=hookmap.load(hooks_path) if hooks_path else None,
        device=parse_device(device), dtype=parse_dtype(dtype) if dtype else None, label=model,
    )
    _stop_progress()
    _emit(report, json_path=json_path, quiet=quiet, html_path=html_path)


def _numbers(text: str | None, option: str) -> list[int] | None:
    """``"0,2,5"`` as ``[0, 2, 5]``."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected whole numbers separated by commas, found {text!r}", param_hint=option) from None


@cli.command("capture", cls=_Running)
@click.argument("model")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="The dump to write (HDF5).")
@click.option("--device", default="cpu", show_default=True, help="Device to run on (cpu, cuda, cuda:N, auto).")
@click.option("--dtype", default=None, help="Dtype to run in [default: a checkpoint directory's own, else float32].")
@_apply(model_options)
@click.option("--hooks", "hooks_path", type=click.Path(dir_okay=False), help="Hook map TOML (default: found by class name).")
@click.option("--compress", type=click.Choice(["lzf", "gzip"]), default=None, help="Compress the tensors [default: off].")
@click.option(
    "--fsync",
    "durable",
    is_flag=True,
    help="Flush the dump to disk before renaming it into place, so that it survives a power loss "
    "(without it, a dump torn by a system crash is refused when read, never misread).",
)
@click.option(
    "--floors",
    metavar="DTYPE[@DEVICE],...",
    default=None,
    help="Measure every check's noise floor at these precisions and store them in the dump, so that "
    "replaying a candidate in one of them is calibrated like a live diff (device default: --device).",
)
@_decode_option(
    "After the prompt (the inputs), N decode steps with a KV cache, every step written (docs/decode.md); "
    "`blockdiff diff OUT CANDIDATE` then replays the candidate's decode against it."
)
@click.option("--cache", type=click.Choice(["dynamic", "static"]), default="dynamic", show_default=True,
              help="With --decode: the Hugging Face cache to decode with.")
@click.option("--max-memory", "max_memory", metavar="SIZE", callback=lambda ctx, param, value: _size_option(value, param),
              help="Read the model's weights from its checkpoint a block at a time, holding at most SIZE of them (e.g. 2GiB).")
@debug_option
def capture_command(
    model: str,
    out: str,
    device: str,
    dtype: str,
    batch: int,
    seq: int,
    seed: int,
    tokens: str | None,
    inputs_path: str | None,
    hooks_path: str | None,
    compress: str | None,
    durable: bool,
    floors: str | None,
    decode: int | None,
    cache: str,
    max_memory: int | None,
) -> None:
    """Run MODEL once and stream every site into an HDF5 dump.

    The inputs are stored in the dump, so a later `blockdiff diff OUT CANDIDATE` replays
    the candidate on the same tokens. Sites are written while the forward runs; the file
    appears at OUT only once complete.

    \b
    Examples:
      blockdiff capture samples/tinylm.py:build --out ref.h5
      blockdiff capture mypkg.models:build --device cuda --dtype bfloat16 \\
        --out gpu.h5 --compress lzf
      blockdiff capture samples/tinylm.py:build --out golden.h5 \\
        --floors bfloat16,float16
      blockdiff diff golden.h5 samples/bugs.py:gelu_for_silu --cand-dtype bfloat16
      blockdiff capture samples/hf_llama.py:build --out dec.h5 --decode 8 --seq 8
      blockdiff diff dec.h5 samples/decode_bugs.py:cache_one_slot_early
      blockdiff capture hf_model_dir --out ref.h5 --max-memory 2GiB
    """
    from . import engine, hookmap
    from .dtypes import parse_dtype
    from .loading import parse_device, parse_precision

    r_device, r_dtype = parse_device(device), (parse_dtype(dtype) if dtype else None)
    precisions = [parse_precision(entry, r_device) for entry in (floors or "").split(",") if entry.strip()]
    made = engine.capture(
        model, _inputs_spec(tokens, inputs_path, batch, seq, seed), out,
        hooks=hookmap.load(hooks_path) if hooks_path else None, compress=compress, label=model, floors=precisions,
        durable=durable, device=r_device, dtype=r_dtype, decode=decode or 0, cache=cache, max_memory=max_memory,
    )
    if made is not None:
        click.echo(f"inputs: {made}", err=True)
    _said(f"wrote {out}")


@cli.command("inspect", short_help="Show what DUMP holds: metadata, sites, shapes, statistics.")
@click.argument("dump")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--verify", is_flag=True, help="Check every tensor's checksum and report the result.")
@debug_option
def inspect_command(dump: str, as_json: bool, verify: bool) -> None:
    """Show what DUMP holds: metadata, and per stage and block its sites with shapes,
    dtypes and statistics.

    \b
    Examples:
      blockdiff inspect ref.h5
      blockdiff inspect ref.h5 --verify
      blockdiff inspect ref.h5 --json > ref.json
    """
    import json

    from .dump import DumpReader
    from .summary import render_summary, summarize

    with DumpReader(dump) as reader:
        checked = reader.verify_all() if verify else None
        summary = summarize(reader)
    if checked is not None:
        summary["verified"] = {"sites": checked.sites, "tensors": checked.tensors, "bytes": checked.bytes}
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        render_summary(summary, _console())


@cli.command("export", short_help="Export every tensor of DUMP to a safetensors file.")
@click.argument("dump")
@click.option("--to", "fmt", type=click.Choice(["safetensors"]), default="safetensors", show_default=True, help="Format to write.")
@click.argument("out")
@debug_option
def export_command(dump: str, fmt: str, out: str) -> None:
    """Export every tensor of DUMP to OUT as a flat safetensors file, keyed by site path
    (MODULE#CALL/output/0, MODULE#CALL/args/0, inputs/0), with a digest manifest
    OUT.manifest.json that blockdiff checks when it reads the file back.

    \b
    Example:
      blockdiff export ref.h5 --to safetensors ref.safetensors
    """
    from .export import export_safetensors, manifest_path

    manifest = export_safetensors(dump, out)
    _said(f"wrote {out} ({len(manifest['tensors'])} tensors) and {manifest_path(out).name}")


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
    from contextlib import ExitStack

    from . import hookmap
    from .render import render_layout
    from .sides.factory import open_side

    with ExitStack() as opened:
        layout = open_side("reference", model, opened=opened, hooks=hookmap.load(hooks_path) if hooks_path else None).layout
    if as_json:
        click.echo(json.dumps(layout.to_dict(), indent=2))
    else:
        render_layout(layout, model, _console())


@contextmanager
def _progress_bar():
    """A transient rich progress bar on stderr for captures and localization, when stderr
    is a terminal; nothing otherwise (pipes, CI, tests)."""
    from .diskweights import READ_PROGRESS
    from .engine import PROGRESS

    from . import distributed

    if not sys.stderr.isatty() or distributed.rank() != 0:
        yield
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    )
    tasks: dict[str, Any] = {}

    def report(what: str, done: int, total: int) -> None:
        if what not in tasks:
            tasks[what] = bar.add_task(what, total=total or None)
        bar.update(tasks[what], completed=done)
        if what == READ_PROGRESS:  # MB, no total: said with their rate
            speed = bar._tasks[tasks[what]].speed
            rate = f", {speed:.0f} MB/s" if speed else ""
            bar.update(tasks[what], description=f"{what}: {done / 1e3:.2f} GB{rate}")

    token = PROGRESS.set(report)
    _state["bar"] = bar
    try:
        with bar:
            yield
    finally:
        _state.pop("bar", None)
        PROGRESS.reset(token)


def _stop_progress() -> None:
    """Take the progress bar off the screen before printing a report."""
    bar = _state.get("bar")
    if bar is not None:
        bar.stop()


# Loggers of other packages whose warnings are not about the user's models: torchao
# (imported by transformers when installed) saying which of its optional CUDA kernels it
# could not load, torch's pytree on the Enums torchao registers, and transformers saying a
# kernel package it looked for is absent (a Mamba mixer runs its PyTorch code). A CLI user
# reads blockdiff's output; BLOCKDIFF_DEBUG keeps them.
QUIETED = ("torchao", "torch.utils._pytree", "transformers.integrations.hub_kernels")


def _quiet_third_parties() -> None:
    import logging

    for name in QUIETED:
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> Any:
    """Entry point of the console script (and of ``python -m blockdiff``)."""
    _state["debug"] = bool(os.environ.get("BLOCKDIFF_DEBUG"))  # --debug sets it per run
    if not _state["debug"]:
        _quiet_third_parties()
    if "WORLD_SIZE" in os.environ:  # a launcher's; distributed imports torch, not needed else
        from . import distributed

        try:
            launched = distributed.launched()
        except ValueError as exc:  # a launcher's variables that are not numbers
            _fail(f"cannot join the launched run: {exc}", exc)
        if launched:
            _one_rank(argv)
    _main(argv)


def _one_rank(argv: list[str] | None) -> None:
    """One rank of a launched run (``torchrun --nproc-per-node N -m blockdiff ...``).

    The default process group is initialised before any factory runs. Rank 0 prints the
    report and writes the files; the other ranks print nothing unless they fail. A rank
    that fails says so in one line naming it (``Error: rank 1: ...``) and every rank
    exits 2 (:class:`~blockdiff.distributed.FailureWatch`); otherwise every rank exits with
    the same code, the verdict being the same on every rank."""
    from . import distributed

    try:
        distributed.init_from_env()
        watch = _state["watch"] = distributed.FailureWatch(code=EXIT_ERROR)
        if watch.rank != 0:
            _silenced()
    except Exception as exc:
        _fail(f"cannot join the launched run ({type(exc).__name__}: {exc})", exc)
    code: Any = 0
    try:
        _main(argv)
    except SystemExit as exc:
        code = exc.code
    if code in (0, EXIT_DIVERGED, None):
        # Every rank the same code, then together out of the group; a rank that fails
        # meanwhile (rank 0 writing the report) still stops the others through the watch.
        try:
            code = distributed.agreed_exit_code(code or 0)
            distributed.finish()
        except Exception as exc:
            _fail(f"could not finish the launched run ({type(exc).__name__}: {exc})", exc)
    watch.stop()
    sys.exit(code)


def _silenced() -> None:
    """A rank other than 0 prints nothing but its own failure: stdout and stderr, down to
    the file descriptors (the warnings of libraries writing there directly), go to the
    null device; its errors go to the stderr it had (:func:`_errors`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _state["stderr"] = os.fdopen(os.dup(2), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _main(argv: list[str] | None) -> Any:
    try:
        return cli.main(args=argv, prog_name="blockdiff", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except _NO_ARGS as exc:  # `blockdiff` alone: the help, not an error
        click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
        sys.exit(0)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "blockdiff"
        _fail(exc.format_message(), exc, hint=f"Try '{where} --help'.")
    except click.ClickException as exc:
        _fail(exc.format_message(), exc)
    except OptionsError as exc:  # the library names parameters; a user of the CLI reads flags
        _fail(exc.spelled(FLAGS), exc)
    except BlockdiffError as exc:
        _fail(str(exc), exc)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # a bug in blockdiff: model code's exceptions are BlockdiffErrors by now
        _internal_error(exc)


def _internal_error(exc: BaseException) -> None:
    """One line naming the error and where its traceback was saved; exit 3."""
    import tempfile

    text = "".join(traceback.format_exception(exc))
    if _state["debug"]:
        click.echo(text, file=_errors(), nl=False)
    saved = ""
    try:
        with tempfile.NamedTemporaryFile("w", prefix="blockdiff-traceback-", suffix=".txt", delete=False) as out:
            out.write(text)
        saved = f"; the traceback is in {out.name}"
    except OSError:
        pass
    message = (
        f"Internal error: {type(exc).__name__}: {exc} (a bug in blockdiff, not in your models{saved}; "
        "please report it, or re-run with --debug)"
    )
    if _announced(message):
        click.echo(_ranked(message), file=_errors())
    sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":  # pragma: no cover
    main()
