"""Regenerate every command output, figure and the command reference in the docs from the pages themselves.

    python docs/generate.py            # rewrite outputs, figures and reference.md in place
    python docs/generate.py --check    # exit 1 and name what is out of date, write nothing

A page documents a command with a ```console block whose first line is `$ maskcli ...`; the rest
of the block is what the command prints (stdout, COLUMNS wide: the site's code width). A figure is an
HTML comment `<!-- figure: maskcli ... --png docs/img/NAME.png -->` before its image, and the command
is written under the image as text. reference.md holds each command's --help-all between
`<!-- help: CMD -->` markers. The small packed batches that docs/pack.md
checks are written here too (docs/batches/*.json, BATCHES below), and the index files and rank masks that
docs/shard.md reads (docs/shard/*.json, shard_files below). tests/test_docs.py runs --check.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The site's code blocks hold 80 columns without scrolling sideways: mkdocs-material caps its grid at 61rem,
# less two 12.1rem sidebars and 1.2rem margins leaves 34.4rem; a code block's text (0.8rem x 0.85 = 0.68rem Roboto
# Mono, 0.6em a character, so 0.408rem) sits inside 0.8rem of padding a side: 32.8 / 0.408 = 80 characters. All in
# rem, so it holds at every font size the theme picks for wide screens.
COLUMNS = "80"
CONSOLE = re.compile(r"```console\n(\$ maskcli [^\n]*(?:\\\n[^\n]*)*)\n(.*?)```", re.S)
FIGURE = re.compile(r"<!-- figure: (maskcli [^>]*?) -->")
# a figure's image, then (generated) its command as text: a blank line and the command in backquotes
CAPTIONED = re.compile(r"(<!-- figure: (maskcli [^>]*?) -->\n!\[[^\]\n]*\]\([^)\n]*\)\n)(?:\n`maskcli [^`\n]*`\n)?")
HELP = re.compile(r"<!-- help: (\w+) -->\n```text\n(.*?)```", re.S)
COMMANDS = ("show", "chunk", "blocks", "diff", "attend", "verify", "inspect", "convert", "kinds", "trace", "pack", "export", "model", "serve", "shard")
BATCH_DIR = DOCS / "batches"
_SAMPLES = [[101, 7, 8, 2], [101, 9, 2], [101, 5, 6, 7, 2]]  # three tokenised samples, 2 = EOS
_IDS = [t for sample in _SAMPLES for t in sample]
_RESTART = [i for sample in _SAMPLES for i in range(len(sample))]
_LABELS = [t if i else -100 for sample in _SAMPLES for i, t in enumerate(sample)]  # -100 at each sample's first token
_CU = [0, 4, 7, 12]
# Each batch as its collator would write it; the failures are the ones users report.
BATCHES = {
    # transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True): every field agrees
    "flattened": {"input_ids": [_IDS], "position_ids": [_RESTART], "labels": [_LABELS], "cu_seq_lens_q": _CU,
                  "cu_seq_lens_k": _CU, "max_length_q": 5, "max_length_k": 5},
    # the same batch padded to 16 tokens with an attention_mask passed beside it, and one boundary's label left in
    "with_attention_mask": {"input_ids": [_IDS + [0] * 4], "position_ids": [_RESTART + [0] * 4],
                            "attention_mask": [[1] * 12 + [0] * 4],
                            "labels": [[t if i not in (0, 7) else -100 for i, t in enumerate(_IDS)] + [-100] * 4],
                            "cu_seq_lens_q": _CU, "cu_seq_lens_k": _CU, "max_length_q": 5, "max_length_k": 5},
    # the flattened batch with cu_seq_lens_q's first boundary one token early: cu_seq_lens_k and position_ids outvote it
    "off_by_one": {"input_ids": [_IDS], "position_ids": [_RESTART], "labels": [_LABELS], "cu_seq_lens_q": [0, 3, 7, 12],
                   "cu_seq_lens_k": _CU, "max_length_q": 5, "max_length_k": 5},
    # a collator that writes flash_attn's cu_seqlens, and position_ids that count on across samples
    "cu_seqlens_only": {"input_ids": [_IDS], "position_ids": [list(range(12))], "cu_seqlens": _CU},
    # two chat samples; every turn ends with EOS (2), so an EOS-keyed document mask splits the turns
    "chat": {"input_ids": [[101, 5, 2, 6, 7, 2, 101, 8, 2, 9, 2]], "position_ids": [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]]},
    # Qwen2-VL-style mRoPE position_ids (3, B, L): an image's tokens share a time position (not packing),
    # and a second sample restarts them (packing, which HF does not read from mRoPE positions)
    "mrope": {"input_ids": [[101, 5, 900, 900, 900, 900, 6, 2, 101, 7, 2]],
              "position_ids": [[[0, 1, 2, 2, 2, 2, 4, 5, 0, 1, 2]], [[0, 1, 2, 2, 3, 3, 4, 5, 0, 1, 2]],
                               [[0, 1, 2, 3, 2, 3, 4, 5, 0, 1, 2]]]},
    # TransformerEngine THD layout: documents of 3 and 2 tokens, each padded to 4 (padding between samples)
    "padded": {"input_ids": [[101, 7, 2, 0, 101, 2, 0, 0]], "attention_mask": [[1, 1, 1, 0, 1, 1, 0, 0]],
               "cu_seqlens": [0, 3, 5], "cu_seqlens_padded": [0, 4, 8]},
}


def shard_files() -> dict[str, object]:
    """The small files docs/shard.md reads (docs/shard/*.json): index lists as a balancer writes them, and the
    per-rank masks a run captures, each reproducing one mistake. Rank r of a 2-rank head-tail split of 8 tokens
    holds positions [0, 1, 6, 7] or [2, 3, 4, 5]; a rank's mask is its rows x every slot in the gathered order
    0, 1, 6, 7, 2, 3, 4, 5 (PyTorch's _create_cp_block_mask convention)."""
    from torch.distributed.tensor.experimental._attention import _PerDocumentHeadTailLoadBalancer

    gathered = [0, 1, 6, 7, 2, 3, 4, 5]
    held = [[0, 1, 6, 7], [2, 3, 4, 5]]
    return {
        # PyTorch's per-document balancer's indices for documents of 16, 16 and 96 tokens over 2 ranks
        "torch_per_document.json": _PerDocumentHeadTailLoadBalancer([[16, 16, 96]], 2, "cpu")._generate_indices()[0].tolist(),
        # 10 tokens cut to 8 so that they split into 2 x 2 chunks: positions 8 and 9 on no rank
        "cut.json": [[0, 1, 6, 7], [2, 3, 4, 5]],
        # causal built on each rank's local indices (row i as position i), not through the layout's indices
        **{f"local_rank{r}.json": [[k <= q for k in range(8)] for q in range(4)] for r in range(2)},
        # is_causal=True where the layer is window(3): plain causal on global positions
        **{f"causal_rank{r}.json": [[gathered[k] <= q for k in range(8)] for q in held[r]] for r in range(2)},
        # a packed batch of documents of 3,000, 5,000 and 192 tokens, as a collator gives its cu_seqlens
        "batch.json": {"cu_seqlens": [0, 3000, 8000, 8192]},
    }


def stale_shard_files(write: bool) -> list[str]:
    import json

    stale = []
    for name, value in shard_files().items():
        path = DOCS / "shard" / name
        text = json.dumps(value) + "\n"
        if not path.is_file() or path.read_text() != text:
            stale.append(f"shard/{name}")
            if write:
                path.parent.mkdir(exist_ok=True)
                path.write_text(text)
    return stale


def batch_text(fields: dict) -> str:
    import json

    return "{\n" + ",\n".join(f"  {json.dumps(name)}: {json.dumps(value)}" for name, value in fields.items()) + "\n}\n"


def stale_batches(write: bool) -> list[str]:
    """The batch files that differ from BATCHES (written afresh where `write`)."""
    stale = []
    for name, fields in BATCHES.items():
        path = BATCH_DIR / f"{name}.json"
        text = batch_text(fields)
        if not path.is_file() or path.read_text() != text:
            stale.append(f"batches/{path.name}")
            if write:
                BATCH_DIR.mkdir(exist_ok=True)
                path.write_text(text)
    return stale


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _args(command: str) -> list[str]:
    args = shlex.split(command.replace("\\\n", " "))
    if args[0] != "maskcli":
        raise ValueError(f"not a maskcli command: {command!r}")
    return args[1:]


def run(command: str, cwd: Path | None = None) -> tuple[int, str]:
    """The command's exit status and stdout, run in-process as a user's terminal at COLUMNS would show it."""
    from typer.testing import CliRunner

    from maskcli.commands import app

    before = os.getcwd()
    os.chdir(cwd or ROOT)
    try:
        result = CliRunner().invoke(app, _args(command), env={"COLUMNS": COLUMNS, "MASKCLI_DEVICE": "cpu", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"},
                                    prog_name="maskcli")
    finally:
        os.chdir(before)
    shown = result.output if _args(command)[:1] == ["trace"] else result.stdout  # trace reports on stderr
    if result.exit_code not in (0, 1) and not shown.strip():
        shown = result.output  # (a refusal says why on stderr: `maskcli model` without transformers, the hf extra)
    return result.exit_code, "\n".join(line.rstrip() for line in shown.splitlines())


def console_blocks(text: str) -> list[tuple[str, str]]:
    """(command, documented output) for each console block of a page."""
    return [(match.group(1).removeprefix("$ "), match.group(2)) for match in CONSOLE.finditer(text)]


def figures(text: str) -> list[str]:
    return [match.group(1) for match in FIGURE.finditer(text)]


def figure_command(command: str) -> str:
    """A figure's command as a reader would run it: the image named without the docs' folder."""
    args = shlex.split(command)
    at = args.index("--png") + 1
    args[at] = Path(args[at]).name
    return shlex.join(args)


def captioned(text: str) -> str:
    """The page with each figure's command as text under its image (the comment above it is invisible)."""
    return CAPTIONED.sub(lambda m: f"{m.group(1)}\n`{figure_command(m.group(2))}`\n", text)


def refreshed_page(text: str) -> str:
    """The page with every console block's output as the command prints it now, and each figure's command under it."""
    text = captioned(text)

    def replace(match: re.Match) -> str:
        command = match.group(1).removeprefix("$ ")
        code, output = run(command)
        if code not in (0, 1):
            raise SystemExit(f"{command!r} exited {code}:\n{output}")
        return f"```console\n{match.group(1)}\n{output}\n```"

    return CONSOLE.sub(replace, text)


def help_text(command: str) -> str:
    """--help-all: the reference lists every option, the ones --help leaves out too."""
    code, output = run(f"maskcli {command} --help-all")
    assert code == 0, output
    return output


def refreshed_reference(text: str) -> str:
    return HELP.sub(lambda m: f"<!-- help: {m.group(1)} -->\n```text\n{help_text(m.group(1))}\n```", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="say what is out of date; write nothing")
    check = parser.parse_args().check
    stale = stale_batches(write=not check) + stale_shard_files(write=not check)
    for page in pages():
        text = page.read_text()
        new = refreshed_reference(refreshed_page(text))
        if new != text:
            stale.append(page.name)
            if not check:
                page.write_text(new)
        if not check:
            for command in figures(text):
                code, output = run(command)
                if code not in (0, 1):
                    raise SystemExit(f"{command!r} exited {code}:\n{output}")
    if check and stale:
        print("out of date: " + ", ".join(stale) + " (run python docs/generate.py)")
        sys.exit(1)


if __name__ == "__main__":
    main()
