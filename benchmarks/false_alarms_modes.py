"""The checks' false alarms on the modes `false_alarms.py` does not run, every family where the mode applies, tiny
(maskcli.hf.families; never a download), each run traced in this process as `maskcli.trace()` traces a program:

    packed      a packed training batch (one row, documents 5 and 3), use_cache=False: position_ids restarting only,
                and DataCollatorWithFlattening's own fields (position_ids, cu_seq_lens_q/k, max_length_q/k); sdpa (eager
                where none) in training mode, flex in eval mode under no_grad (no backward or dropout on CPU)
    right       a right-padded training batch (labels, -100 on the padding), use_cache=False; sdpa, eager
    attentions  left-padded generate with output_attentions=True, eager
    beams       left-padded generate with num_beams=2 (the cache reordered each step); sdpa (eager where none)
    seq2seq     the encoder-decoder families: generate on a padded encoder input (right, then left); sdpa, eager
    vlm         vision-language families with an image (pixel_values, the image token repeated as its features
                count), left-padded generate; sdpa (benchmarks/false_alarms_vlm.py)

Each run is also checked without maskcli, by what its outputs depend on (the claim a padding or mask finding makes):
the padding's ids changed (a real token's logits move: the model attends to padding), the first document's ids
changed (the second document's logits move: it attends across documents), the last token changed (an earlier one's
logits move: it sees later tokens), and in the packed mode the first document run alone (its logits move: the packing
numbered its positions otherwise than the model does). A wrong finding is true where what its code claims moved (CLAIMS), else a false
alarm (a code CLAIMS does not list too: looked at by hand). Not a timing: run by hand (minutes), read the table and
its last line.

    python benchmarks/false_alarms_modes.py [--mode MODE ...] [FAMILY ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

# what each wrong finding claims the outputs depend on; a code not here is confirmed by nothing (a false alarm until
# looked at by hand). real-query-blind: XLM's rows built from the ids alone, which see the padding as well
CLAIMS = {"padding-ignored": "padding", "padding-lost": "padding", "real-query-blind": "padding",
          "encoder-padding-ignored": "padding", "documents-leak": "across documents", "varlen-leak": "across documents",
          "sees-its-target": "sees later", "sees-later": "sees later", "causal-lost": "sees later",
          "left-pads-never-masked": "padding", "samples-leak": "across documents",
          "chunk-lookahead-compounds": "sees later", "mask-none-differs": "sees later", "one-pass-sees-later": "sees later",
          "samples-see-other-memories": "across documents", "padding-seen-by-one": "padding",
          "window-escaped": "beyond the window",  # (a sliding layer's keys past its window: no mode checks it either)
          "handed-mask-made-causal": "a prefix made causal",  # (later keys a handed mask shows, hidden: nor this one)
          "emptied-after-softmax": "a query that reads nothing",  # (no mode's check confirms these two: no family
          "joint-text-cut": "text cut",  # multiplies its weights after a softmax or drops a prompt's real tokens: any
          # such finding here is one to look at by hand)
          "window-differs-at-decode": "a window of another width",  # (nor this: a family whose prefill and decode
          # lay two windows; its prompt's logits against the same tokens decoded one at a time would confirm it)
          "document-row-empty": "a query that reads nothing",  # (a packed document's token cut out of it: the packed
          # mode's check confirms a leak only where a finite fill spreads the row over other documents)
          "unmasked-after-softmax": "sees later",  # (keys a softmax masks weighted again after it: later keys or
          # padding, whichever its mask hid; no family re-softmaxes or adds to its weights: any finding is looked at)
          "fill-masks-nothing": "sees later",  # (a fill of about zero: the cells it masks, often later keys or pads,
          # keep their weight; padding where the mask was a key padding mask)
          "named-causal-sees-later": "sees later",
          "position-padding-row": "positions unlike alone",  # (the packed mode's first document, run alone with the
          # model's own numbering: RoBERTa's family counts from padding_idx + 1, the flattening collator from 0)
          "nan-rows-backward": "NaN gradients",  # (no mode runs a backward pass: looked at by hand)
          "unlike-run-alone": "a document attended otherwise than alone",  # (a stretch the program runs alone too:
          # no mode runs a batch beside a stretch of it alone; any such finding here is one to look at by hand)
          "block-mask-one-row": "keys a later batch row's mask_mod keeps",  # (a B=None BlockMask over a batch: no
          # family builds a flex BlockMask per batch; any such finding here is one to look at by hand)
          "document-unlike-alone": "a document attended otherwise than alone",  # (no mode runs a packed batch beside
          # each of its documents alone through one call site: any such finding here is one to look at by hand)
          "swin-roll-shift": "windows of other tokens",  # (a vision block's map rolled by another shift: no language
          # family's mode runs one; looked at by hand)
          "memory-rows-shifted": "padding",  # (a cross-attention's rows on the padding: no language family holds
          # one; looked at by hand)
          "cache-window-overrun": "beyond the window",  # (keys a window cache object says it let go: no family holds
          # one; any such finding here is one to look at by hand)
          "patches-run-causal": "sees later",  # (a vision tower handed a patch mask, run causal: the vlm mode's
          # families take pixel_values, not a patch mask; looked at by hand)
          "window-lopsided": "beyond the window",  # (a both-ways sliding layer wider on one side: a family run with
          # use_bidirectional_attention would confirm it; looked at by hand)
          "window-keys-dropped": "a window of another width",  # (keys a sliding cache dropped inside the window: no
          # mode feeds a second multi-token turn to a wrapped cache; looked at by hand)
          "mask-rows-same-shard": "another shard's mask rows",  # (no family splits its queries over context-parallel
          # shards: any such finding here is one to look at by hand)
          "blocks-seen-before-they-end": "sees later",
          "causal-argument-ignored": "a both-ways call run causal",  # (a model call handed is_causal=False: no mode
          # hands one; any such finding here is one to look at by hand)
          "frames-over-cache": "beyond the window",
          "zero-memory-seen": "padding",
          "frames-see-later-blocks": "sees later",  # (frames a video model's rolling cache evicts: no language
          # family states local_attn_size; looked at by hand)
          "chunk-left-context": "a window of another width",  # (a streaming encoder's chunk config held in its frames:
          # no language family holds one; looked at by hand)
          "prefix-blocks-swapped": "a prefix the later part never reads",  # (two held inputs laid end to end: no
          # family's mode conditions one input on another it lays first; looked at by hand)
          "empty-rows-differ": "a query that reads nothing"}  # (one module run along two paths over one mask: no
# mode runs both; looked at by hand)
MOVES = 1e-5  # logits that differ by more than this moved (masked cells weigh exactly 0: unmoved logits are equal)


def traced(work):
    """(wrong findings, suspicious findings) of the checks on what `work()` runs, traced as maskcli.trace() does."""
    import maskcli
    from maskcli.checks.registry import severity

    with maskcli.trace() as t:
        work()
    found = [(severity(f), f.code, f.message, g.name) for g in t.groups() for f in g.findings]
    return [f for f in found if f[0] == "wrong"], [f for f in found if f[0] == "suspicious"]


def moved(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def causal_model(name: str, attn: str):
    """The family tiny, with `attn` ("sdpa|eager": sdpa where the family has it, else eager)."""
    from maskcli.errors import MaskError
    from maskcli.hf.families import default_config, tiny
    from maskcli.hf.run import build, check_attn

    config = tiny(default_config(name), name=name)
    choices = attn.split("|")
    for choice in choices:
        try:
            check_attn(config, choice, name)
        except MaskError:
            if choice == choices[-1]:
                raise
            continue
        return build(config, choice, name)


def other_id(avoid: set, vocab: int, start: int = 11) -> int:
    return next(t for t in range(start, start + vocab) if t % vocab not in avoid) % vocab


# --- the modes over causal-LM families -------------------------------------------------------------------------------

def packed(name: str, attn: str, flattening: bool):
    """One row of documents 5 and 3 as DataCollatorWithFlattening packs them (labels, position_ids restarting; with
    its flash fields where `flattening`), use_cache=False, in training mode."""
    from transformers import DataCollatorWithFlattening

    model = causal_model(name, attn)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    first = [other_id({pad}, vocab, t) for t in (3, 4, 5, 6, 7)]
    second = [other_id({pad}, vocab, t) for t in (20, 21, 22)]
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flattening, return_position_ids=True)

    def batch(one, two):
        fields = collate([{"input_ids": one}, {"input_ids": two}], return_tensors="pt")
        return fields if flattening else {key: fields[key] for key in ("input_ids", "labels", "position_ids")}

    def work():
        if attn == "flex":  # (flex_attention has no backward on CPU, and no dropout)
            with torch.no_grad():
                model(**batch(first, second), use_cache=False)
        else:
            model.train()
            model(**batch(first, second), use_cache=False)

    def check():
        model.eval()
        with torch.no_grad():
            base = model(**batch(first, second), use_cache=False).logits[0]
            other = model(**batch([other_id({pad, t}, vocab, t + 40) for t in first], second), use_cache=False).logits[0]
            later = model(**batch(first, second[:-1] + [other_id({pad, second[-1]}, vocab, 60)]), use_cache=False).logits[0]
            alone = model(input_ids=torch.tensor([first]), use_cache=False).logits[0]  # (numbered as the model does)
        found = {}
        if moved(base[:5], alone) > MOVES:
            found["positions unlike alone"] = moved(base[:5], alone)
        if moved(base[5:], other[5:]) > MOVES:
            found["across documents"] = moved(base[5:], other[5:])
        if moved(base[:-1], later[:-1]) > MOVES:
            found["sees later"] = moved(base[:-1], later[:-1])
        return found
    return work, check


def right_padded(name: str, attn: str):
    """Rows of 5 and 3 tokens padded on the right, labels -100 on the padding, use_cache=False, training mode."""
    model = causal_model(name, attn)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    rows = [[other_id({pad}, vocab, t) for t in (3, 4, 5, 6, 7)], [other_id({pad}, vocab, t) for t in (20, 21, 22)]]
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2])

    def ids(fill: int, last: int | None = None):
        out = torch.tensor([rows[0], rows[1] + [fill] * 2])
        if last is not None:
            out[0, 4] = last
        return out

    def work():
        model.train()
        labels = ids(pad).masked_fill(mask == 0, -100)
        model(input_ids=ids(pad), attention_mask=mask, labels=labels, use_cache=False)

    def check():
        model.eval()
        with torch.no_grad():
            base = model(input_ids=ids(pad), attention_mask=mask, use_cache=False).logits
            other = model(input_ids=ids(other_id({pad}, vocab, 50)), attention_mask=mask, use_cache=False).logits
            later = model(input_ids=ids(pad, other_id({pad, rows[0][4]}, vocab, 60)), attention_mask=mask, use_cache=False).logits
        found = {}
        if moved(base[1, :3], other[1, :3]) > MOVES:
            found["padding"] = moved(base[1, :3], other[1, :3])
        if moved(base[0, :4], later[0, :4]) > MOVES:
            found["sees later"] = moved(base[0, :4], later[0, :4])
        return found
    return work, check


def left_generate(name: str, attn: str, **options):
    """generate on rows of 5 and 3 tokens padded on the left, greedy, 3 new tokens, with `options`."""
    model = causal_model(name, attn)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    rows = [[other_id({pad}, vocab, t) for t in (3, 4, 5, 6, 7)], [other_id({pad}, vocab, t) for t in (20, 21, 22)]]
    mask = torch.tensor([[1] * 5, [0] * 2 + [1] * 3])

    def generated(fill: int):
        ids = torch.tensor([rows[0], [fill] * 2 + rows[1]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                 pad_token_id=pad, return_dict_in_generate=True, output_logits=True, **options)
        return torch.stack(out.logits, 1)

    def work():
        model.eval()
        generated(pad)

    def check():
        base, other = generated(pad), generated(other_id({pad}, vocab, 50))
        return {"padding": moved(base, other)} if moved(base, other) > MOVES else {}
    return work, check


MODES = {
    "packed": lambda name: [(f"{attn} {how}", lambda attn=attn, flat=flat: packed(name, attn, flat))
                            for attn in ("sdpa|eager", "flex") for how, flat in (("position_ids", False), ("flattening", True))],
    "right": lambda name: [(attn, lambda attn=attn: right_padded(name, attn)) for attn in ("sdpa", "eager")],
    "attentions": lambda name: [("eager", lambda: left_generate(name, "eager", output_attentions=True))],
    "beams": lambda name: [("sdpa|eager", lambda: left_generate(name, "sdpa|eager", num_beams=2))],
}


def families(mode: str) -> list[str]:
    if mode in ("seq2seq", "vlm"):
        import false_alarms_vlm

        return false_alarms_vlm.families(mode)
    from maskcli.hf.families import names

    return names()


def runs(mode: str, name: str) -> list:
    if mode in ("seq2seq", "vlm"):
        import false_alarms_vlm

        return false_alarms_vlm.runs(mode, name)
    return MODES[mode](name)


def main(argv: list[str]) -> int:
    from maskcli.errors import MaskError
    from maskcli.hf import quiet, reason
    from maskcli.hf.run import _flex_uncompiled  # (transformers' flex path compiles: run uncompiled, as `model --attn flex`)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="*", default=[*MODES, "seq2seq", "vlm"])
    parser.add_argument("families", nargs="*")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # (tiny models: a second thread only waits, on a shared machine)
    table = defaultdict(lambda: {"families": set(), "runs": 0, "wrong": 0, "suspicious": 0, "true": 0, "false": 0, "not run": 0, "seconds": 0.0})
    started = time.perf_counter()
    for mode in args.mode:
        for name in [name for name in args.families if name in families(mode)] if args.families else families(mode):
            for label, make in runs(mode, name):
                row = table[mode]
                began = time.perf_counter()
                try:
                    with quiet(), _flex_uncompiled(True):
                        work, check = make()
                        wrong, suspicious = traced(work)
                        leaks = check() if wrong or suspicious else {}
                except (MaskError, Exception) as error:  # noqa: BLE001 - a family that refuses the mode: say why, go on
                    row["not run"] += 1
                    print(f"{mode} {name} {label}: not run ({reason(error)[:100]})", flush=True)
                    continue
                row["seconds"] += time.perf_counter() - began
                row["families"].add(name)
                row["runs"] += 1
                row["wrong"] += bool(wrong)
                row["suspicious"] += bool(suspicious)
                codes = sorted({f[1] for f in wrong})
                said = "; ".join(f"{k} {v:.2g}" for k, v in leaks.items()) or "nothing moved"
                unconfirmed = [code for code in codes if CLAIMS.get(code) not in leaks]
                if wrong and not unconfirmed:
                    row["true"] += 1
                    print(f"{mode} {name} {label}: true: {','.join(codes)} ({said}): {wrong[0][2][:200]}", flush=True)
                elif wrong:
                    row["false"] += 1
                    print(f"{mode} {name} {label}: FALSE ALARM {','.join(unconfirmed)} ({said}): "
                          f"{next(f[2] for f in wrong if f[1] in unconfirmed)[:200]}", flush=True)
                if suspicious:
                    print(f"{mode} {name} {label}: suspicious {','.join(sorted({f[1] for f in suspicious}))} ({said}): "
                          f"{suspicious[0][2][:200]}", flush=True)
    print(f"{'mode':12s} {'families':>8s} {'runs':>5s} {'wrong':>5s} {'true':>5s} {'false':>5s} {'susp.':>5s} {'not run':>7s} {'s':>5s}")
    for mode, row in table.items():
        print(f"{mode:12s} {len(row['families']):8d} {row['runs']:5d} {row['wrong']:5d} {row['true']:5d} {row['false']:5d} "
              f"{row['suspicious']:5d} {row['not run']:7d} {row['seconds']:5.0f}")
    alarms = sum(row["false"] for row in table.values())
    print(f"{sum(row['runs'] for row in table.values())} runs, {alarms} false alarms, "
          f"{sum(row['true'] for row in table.values())} wrong findings the outputs confirm, {time.perf_counter() - started:.0f} s")
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
