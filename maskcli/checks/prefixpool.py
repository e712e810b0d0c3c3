"""An attention pool whose keys hold the prefix tokens the model states its pooling leaves out.

A ViT with class and register tokens before its patches states how many there are (timm's `num_prefix_tokens`) and,
with `pool_include_prefix` (NaFlexVit) or `reduce_include_prefix` = False, that its global pooling reads the patches
alone (trace/prefixpool.py reads both, on the model's attributes or a config it keeps). Its blocks attend all N
tokens, prefix first (calls of N queries over N keys); its attention pool (a MAP head: a few latent queries over the
tokens, after every block) should then attend the N - P patches: handed `x[:, P:]`, or handed all N with the prefix
keys hidden. Wrong where a pool call made after the blocks, under the module that states both, has the blocks' N keys
and a query of some batch row sees a key among the first P (huggingface/pytorch-image-models 4d9c87bb: NaFlexVit._pool
dropped the prefix only `if self.pool_include_prefix`, the test inverted, so with the default False the MAP latent
attended the class and register tokens). Quiet where the pool has N - P keys (sliced: the fix), where its mask hides
the first P keys in every row, where the blocks attend more than one length (nothing says which is the pooled one) and
where nothing states the flag (timm's VisionTransformer pools every token with its MAP head, as it means to).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _under(call, scope: str) -> bool:
    where = call.where or ""
    return not scope or where == scope or where.startswith(scope + ".")


def pooled_prefix(run: Run) -> list:
    """Pool calls over the blocks' N tokens in which a query sees one of the P prefix tokens the model leaves out."""
    found = []
    for top in run.tops:
        said = next((one for one in top.stated if "prefix_pool" in one.fields), None)
        if said is None:
            continue
        count, scope = said.fields["prefix_pool"], said.fields.get("prefix_scope") or ""
        calls = sorted((c for c in (*run.calls, *run.cross, *run.unmasked)
                        if top.first <= c.index < top.end and _under(c, scope)), key=lambda c: c.index)
        blocks = [c for c in calls if c.shape[2] == c.shape[3] > 1]
        lengths = {int(c.shape[3]) for c in blocks}
        if len(lengths) != 1 or next(iter(lengths)) <= count:
            continue
        length, last = lengths.pop(), max(c.index for c in blocks)
        done = set()
        for call in calls:
            rows, q_len, k_len = int(call.shape[0]), int(call.shape[2]), int(call.shape[3])
            if call.index < last or k_len != length or q_len >= k_len or (call.where, call.shape) in done:
                continue
            cells = keep(call)
            if cells is None and call.stored is not None:
                continue  # (a mask too big to read, or one maskcli could not read: nothing said of its keys)
            seen = np.ones((rows, q_len, count), dtype=bool) if cells is None else \
                np.broadcast_to(cells[..., :count].any(axis=1), (rows, q_len, count))
            if not seen.any():
                continue
            done.add((call.where, call.shape))
            b, q, k = (int(i) for i in np.argwhere(seen)[0])
            rows_seen = int(seen.any(axis=(1, 2)).sum())
            found.append((call, Finding("pool-sees-prefix", (
                f"batch row {b}: pool query {q} sees key {k}, one of the {count} prefix tokens that lead the blocks' "
                f"{length} tokens, though {said.source} say the pool reads the patches alone "
                f"({rows_seen} of {rows} rows see the prefix): the pool was handed the prefix tokens it leaves out"),
                expected=f"the pool's keys are the {length - count} patches (keys {count}..{length - 1}), the first "
                         f"{count} left out or hidden", source=said.source, cell=(b, q, k))))
    return found


RULES = (
    Rule("pool-sees-prefix", "wrong", "call", "an attention pool (MAP head) that attends the class and register tokens "
         "the model states its pooling leaves out (pool_include_prefix=False beside num_prefix_tokens)", pooled_prefix),
)
