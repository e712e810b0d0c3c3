"""One step of a serving engine's batch, in the engine's own terms read into one neutral form.

Engines keep no mask tensor: the mask is what their metadata implies. A request has `q_len`
new tokens (its queries) and `seq_len` keys, read through its page table; the kernels align
the last query with the last key (flash_attn's and FlashInfer's bottom-right causal), so the
queries sit at absolute positions `seq_len - q_len .. seq_len - 1` and the keys at `0 .. seq_len - 1`.
Pages are kept as one CSR list per request (logical block -> physical page), O(requests + pages).
A request's mask is the kinds its metadata states (`kinds`) at those positions: `mask` makes its Mask of them
directly (sources/engine.py hands those Masks on), `expression` writes their text only to name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from maskcli.errors import MaskError


@dataclass(frozen=True, eq=False)
class Cascade:
    """vLLM's cascade split: every query attends the first `prefix_len` keys (shared pages), then its own suffix."""

    prefix_len: int
    prefix_query: np.ndarray | None  # cu_prefix_query_lens: [0, all tokens]
    prefix_kv: np.ndarray | None  # prefix_kv_lens: [prefix_len]
    suffix_kv: np.ndarray | None  # suffix_kv_lens: seq_lens - prefix_len


@dataclass(frozen=True, eq=False)
class Local:
    """vLLM's chunked-local virtual batches, beside the real batch they were made from."""

    q_indptr: np.ndarray  # local_query_start_loc
    seq_lens: np.ndarray  # local_seqused_k
    tables: np.ndarray  # local_block_table (V, blocks)


@dataclass(frozen=True, eq=False)
class ServeBatch:
    """A batch's attention metadata: per request its queries, keys, pages, writes and mask parameters."""

    engine: str
    q_indptr: np.ndarray  # (R+1,) where each request's queries start in q
    seq_lens: np.ndarray  # (R,) keys the kernel reads per request
    page_size: int
    page_indptr: np.ndarray  # (R+1,) CSR over `pages`
    pages: np.ndarray  # physical page of each logical block, from block 0, as many as the keys need
    names: dict[str, str]  # role -> the engine's own field name (for messages)
    computed: np.ndarray | None = None  # (R,) tokens cached before this step, where the engine states it
    key_start: np.ndarray | None = None  # (R,) first key's column in the page table (flash_attn's cache_leftpad)
    last_fill: np.ndarray | None = None  # (R,) keys in each request's last page, where the engine states it
    short_table: np.ndarray | None = None  # (R,) bool: the table row had fewer blocks than the keys need
    null_page: int | None = None  # the page id that stands for "no page" (vLLM's null block 0, SGLang's slot 0)
    write_slots: np.ndarray | None = None  # (N,) the slot each new token is written to (page * page_size + offset)
    tokens: int | None = None  # the query tokens q holds, where a per-token field says (slot_mapping, positions)
    causal: bool = True
    window: int | None = None  # W keys including self
    chunk: int | None = None  # local(C)
    cascade: Cascade | None = None
    local: Local | None = None
    trees: dict[int, np.ndarray] = field(default_factory=dict)  # request -> bool (q_len, seq_len) custom mask
    # request -> keys before its tree's stored cells, every one seen (TensorRT-LLM's mask holds only the drafts:
    # a tree 10^9 tokens behind its cache is not a (nodes, 10^9) array)
    tree_prefix: dict[int, int] = field(default_factory=dict)
    request_ids: np.ndarray | None = None  # (R,) which request is which across step files
    positions: np.ndarray | None = None  # (N,) each query token's position as the engine states it
    choices: tuple[tuple[int, ...], ...] = ()  # a static tree's choice list (serve/choices.py): every tree is that tree
    choices_name: str = ""  # the field that held it
    notes: tuple[str, ...] = ()

    @property
    def requests(self) -> int:
        return len(self.seq_lens)

    @cached_property
    def q_lens(self) -> np.ndarray:
        """Computed once (per-request code reads it a million times in a batch of a million requests); read-only."""
        values = np.diff(self.q_indptr)
        values.flags.writeable = False
        return values

    @cached_property
    def q_start(self) -> np.ndarray:
        """Each request's first query position as the kernel aligns it (bottom-right): seq_len - q_len."""
        values = self.seq_lens - self.q_lens
        values.flags.writeable = False
        return values

    @property
    def starts(self) -> np.ndarray:
        return self.key_start if self.key_start is not None else np.zeros(self.requests, np.int64)

    def name(self, role: str) -> str:
        return self.names.get(role, role)

    def request_pages(self, r: int) -> np.ndarray:
        return self.pages[self.page_indptr[r]:self.page_indptr[r + 1]]

    def kinds(self, r: int) -> tuple[tuple[str, object], ...] | None:
        """The kinds request r's mask is, and-ed, each with its one parameter (None for none): (("prefix", 5),
        ("window", 8)); a draft tree's parents as an int64 array. None where no frame holds the request."""
        q_len, seq_len = int(self.q_lens[r]), int(self.seq_lens[r])
        if q_len > seq_len or seq_len == 0:
            return None
        if r in self.trees:
            parents = self.read_tree(r).parents
            if not np.array_equal(parents, np.arange(len(parents)) - 1):  # a chain is plain causal
                return (("tree", parents),)
        if self.cascade is not None:
            return (("prefix", self.cascade.prefix_len),) + ((("window", self.window),) if self.window else ())
        if not self.causal:
            return (("full", None),)
        if self.chunk is not None:
            return (("local", self.chunk),)
        if self.window is not None:
            return (("window", self.window),)
        return (("causal", None),)

    def expression(self, r: int) -> str | None:
        """The request's mask as a maskcli expression, to be shown (its frame: `frame(r)`); None where no frame
        holds it. `mask(r)` is made from the same kinds, never from this text."""
        kinds = self.kinds(r)
        if kinds is None:
            return None
        return " & ".join(name if value is None else
                          f"{name}({','.join(map(str, value.tolist())) if isinstance(value, np.ndarray) else value})"
                          for name, value in kinds)

    def read_tree(self, r: int, parents: np.ndarray | None = None, hidden: int = 0):
        """The draft tree request r's custom mask holds, and its first cell off it (serve/trees.py's read_tree; with
        `parents`, off that tree instead)."""
        from maskcli.serve.trees import read_tree

        return read_tree(self.trees[r], parents, hidden)

    @cached_property
    def choice_parents(self) -> np.ndarray | None:
        """The parent of each node of the tree the choice list names (serve/choices.py); None without one."""
        if not self.choices:
            return None
        from maskcli.serve import choices

        return choices.parents(list(self.choices))

    def choice_path(self, node: int) -> str:
        """How a message names draft `node` of the choice list's tree: the root, or its path."""
        from maskcli.serve import choices

        return choices.path_of(list(self.choices), node)

    def frame(self, r: int) -> tuple[int, int, int]:
        """(first query position, queries, keys) of request r."""
        return int(self.q_start[r]), int(self.q_lens[r]), int(self.seq_lens[r])

    def mask(self, r: int):
        """The request's Mask, made from its kinds at its positions (mask.from_terms: no expression is written or
        parsed); None where no frame holds it or it has no queries."""
        kinds = self.kinds(r)
        q_start, q_len, seq_len = self.frame(r)
        if kinds is None or q_len == 0:
            return None
        from maskcli import expression as ex
        from maskcli.kinds import get
        from maskcli.kinds.values import inline
        from maskcli.mask import from_terms
        from maskcli.positions import Frame
        from maskcli.terms import Term

        made = []
        for name, value in kinds:
            kind = get(name)
            if name == "tree":
                if len(value) != q_len:
                    raise MaskError(f"request {r}'s draft tree has {len(value)} nodes for its {q_len} queries")
                value = inline(value[None, :], f"request {r}'s draft tree")
            values = {param.name: param.default for param in kind.params}
            if kind.params:
                values[kind.params[0].name] = kind.params[0].check(value, f"request {r}'s {name}")
            made.append(Term(kind, tuple(values.items())))
        tree = made[0] if len(made) == 1 else ex.And(tuple(made))
        return from_terms(tree, Frame(q_start, q_len, 0, seq_len))

    def blocks(self) -> np.ndarray:
        """(R,) blocks each request's keys need: ceil((first column + seq_len) / page_size)."""
        return -(-(self.starts + self.seq_lens) // self.page_size)


def cumulative(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(values, dtype=np.int64)])


def table_rows(table: np.ndarray, needed: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indptr, pages, short) from a padded (R, blocks) table: each row's first `needed` entries, vectorised."""
    if table.ndim != 2:
        raise MaskError(f"{where} has shape {list(table.shape)}: a block table is (requests, blocks)")
    if table.shape[0] < len(needed):
        raise MaskError(f"{where} has {table.shape[0]} rows for {len(needed)} requests: give one row per request")
    short = needed > table.shape[1]
    take = np.minimum(needed, table.shape[1])
    keep = np.arange(table.shape[1])[None, :] < take[:, None]
    return cumulative(take), table[: len(needed)][keep[: len(needed)]], short


def validate(b: ServeBatch, source: str) -> None:
    """Refuse what no engine writes: negative lengths, a window or chunk under 1 (a wrong batch is a finding, not this)."""
    for role, values in (("seq_lens", b.seq_lens), ("computed", b.computed), ("key_start", b.key_start)):
        if values is not None and values.size and values.min() < 0:
            r = int(np.argmin(values))
            raise MaskError(f"{source!r}: {b.name(role)} is {int(values[r])} for request {r}; lengths are 0 or more")
    q_lens = np.diff(b.q_indptr)
    if q_lens.size and q_lens.min() < 0:
        r = int(np.argmin(q_lens))
        raise MaskError(f"{source!r}: {b.name('queries')} is {int(q_lens[r])} for request {r}; a request has 0 or more new tokens")
    if b.cascade is not None and b.cascade.prefix_len < 0:
        raise MaskError(f"{source!r}: common_prefix_len {b.cascade.prefix_len} is negative; it counts the keys every request "
                        f"shares (0 for none)")
    for role, value in (("window", b.window), ("chunk", b.chunk)):
        if value is not None and value < 1:
            name = {"window": b.name("window"), "chunk": "attention_chunk_size"}[role]
            raise MaskError(f"{source!r}: {name} {value} leaves no key; a {role} holds at least 1 token (leave it out for none)")
