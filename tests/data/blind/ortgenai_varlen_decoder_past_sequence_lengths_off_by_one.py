# microsoft/onnxruntime-genai#2354 (commit 1cae16873, "Fix off-by-one past_sequence_lengths in the varlen decoder").
#
# The engine's VarlenDecoderIO hands the PagedAttention op `past_sequence_lengths` (where a request's step starts
# writing into the paged KV cache; the op also derives the RoPE positions from it) next to `cumulative_sequence_lengths`
# and a block table. During prefill it was `CurrentSequenceLength() - unprocessed` (= 0), but during decode it was
# `CurrentSequenceLength()`, which already counts the token about to be processed: a 9-token prompt gave 0, 10, 11, ...
# instead of 0, 9, 10, .... The cache reservation used the same shifted convention, so slot L was never written but
# was read on every decode step (holding whatever a recycled block last held), and each generated token was rotated
# one position too far. The fix makes Request::ProcessedSequenceLength() the source of truth for the past length
# (and for IsPrefill()), kv_len = CurrentSequenceLength(), RequiredSlots = CurrentSequenceLength().
#
# Port (src/engine/request.cpp, decoders/varlen_decoder_io.cpp, paged_key_value_cache.cpp, admission.h) with a tiny
# decoder whose attention is a plain-torch PagedAttention (com.microsoft contrib op semantics: token j of sequence i
# is written at past_seqlens[i] + j and rotated at that position; causal over past + q_len keys via the block table).
import sys

import torch

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class Cfg:
    vocab_size = 64
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    head_size = 8
    context_length = 64
    block_size = 4
    num_blocks = 16
    pad_token_id = 0
    rope_theta = 10000.0


config = Cfg()


# ---------------------------------------------------------------- admission.h
def RequiredSlotsArith(sequence_length, unprocessed_count, is_prefill):
    return sequence_length if is_prefill else sequence_length + unprocessed_count


# ---------------------------------------------------------------- block pool
class Block:
    def __init__(self, block_id, block_size):
        self.id = block_id
        self.block_size = block_size
        self.size = 0

    def Size(self):
        return self.size

    def EmptySlots(self):
        return self.block_size - self.size

    def IsFull(self):
        return self.size == self.block_size

    def AddSlot(self):
        self.size += 1


class BlockPool:
    def __init__(self, block_size, num_blocks):
        self.block_size = block_size
        self.free = [Block(i, block_size) for i in reversed(range(num_blocks))]

    def BlocksNeeded(self, num_slots):
        return (num_slots + self.block_size - 1) // self.block_size

    def AvailableBlocks(self):
        return len(self.free)

    def ReserveBlocks(self, num_slots):
        return [self.free.pop() for _ in range(self.BlocksNeeded(num_slots))]

    def AllocateBlocks(self, num_slots):
        blocks = []
        for _ in range(self.BlocksNeeded(num_slots)):
            block = self.free.pop()
            n = min(num_slots, self.block_size)
            block.size = n
            num_slots -= n
            blocks.append(block)
        return blocks

    def Free(self, blocks):
        # The slots are released; the cache memory behind them is not cleared.
        for block in blocks:
            block.size = 0
            self.free.append(block)


# ---------------------------------------------------------------- request.cpp
class Request:
    def __init__(self, prompt, max_length):
        self.prefill_input_ids_ = list(prompt)
        self.sequence = []  # search_->GetSequence(0)
        self.max_length = max_length
        self.processed_sequence_length_ = 0
        self.is_prefill_ = True

    def Assign(self):
        self.processed_sequence_length_ = 0 if FIXED else self.CurrentSequenceLength()
        self.sequence.extend(self.prefill_input_ids_)
        self.prefill_input_ids_ = []

    def CurrentSequenceLength(self):
        return len(self.sequence)

    def ProcessedSequenceLength(self):
        return self.processed_sequence_length_

    def UnprocessedTokensCpu(self):
        return self.sequence[self.processed_sequence_length_:self.CurrentSequenceLength()]

    def IsPrefill(self):
        if FIXED:
            return self.processed_sequence_length_ == 0
        return self.is_prefill_

    def PrepareGeneration(self, logits):
        self.processed_sequence_length_ = len(self.sequence)
        if not FIXED:
            self.is_prefill_ = False

    def GenerateNextTokens(self, logits):
        self.PrepareGeneration(logits)
        self.sequence.append(int(logits.argmax(-1)))  # SelectTop

    def IsDone(self):
        return self.CurrentSequenceLength() >= self.max_length


# ---------------------------------------------------------------- paged_key_value_cache.cpp
def RequiredSlots(request):
    if FIXED:
        return request.CurrentSequenceLength()
    sequence_length = request.CurrentSequenceLength()
    unprocessed_count = 0 if request.IsPrefill() else len(request.UnprocessedTokensCpu())
    return RequiredSlotsArith(sequence_length, unprocessed_count, request.IsPrefill())


class PagedKeyValueCache:
    def __init__(self, cfg):
        shape = (cfg.num_blocks, cfg.block_size, cfg.num_key_value_heads, cfg.head_size)
        self.cache_ = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
        self.block_pool_ = BlockPool(cfg.block_size, cfg.num_blocks)
        self.block_tables_ = []  # [request, blocks]

    def _table(self, request):
        for entry in self.block_tables_:
            if entry[0] is request:
                return entry
        raise RuntimeError("Given request is not found in the cache.")

    def Add(self, request):
        self.block_tables_.append([request, self.block_pool_.ReserveBlocks(RequiredSlots(request))])

    def AppendTokens(self, request):
        blocks = self._table(request)[1]
        required_slots = RequiredSlots(request)
        used_slots = sum(b.Size() for b in blocks)
        if required_slots <= used_slots:
            return
        num_slots = required_slots - used_slots
        for block in blocks:
            while num_slots > 0 and not block.IsFull():
                block.AddSlot()
                num_slots -= 1
            if num_slots == 0:
                break
        if num_slots > 0:
            blocks.extend(self.block_pool_.AllocateBlocks(num_slots))

    def Remove(self, request):
        entry = self._table(request)
        self.block_pool_.Free(entry[1])
        self.block_tables_.remove(entry)

    def BlockTables(self, scheduled_requests):
        columns = max(len(self._table(r)[1]) for r in scheduled_requests)
        table = torch.zeros(len(scheduled_requests), columns, dtype=torch.int32)
        for i, r in enumerate(scheduled_requests):
            ids = [b.id for b in self._table(r)[1]]
            table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table

    def Cache(self):
        return self.cache_


# ---------------------------------------------------------------- decoders/varlen_decoder_io.cpp
class VarlenDecoderIO:
    def __init__(self, cache_manager):
        self.cache_manager_ = cache_manager
        self.inputs_ = {}

    def PrepareInputIds(self, scheduled_requests):
        ids, cumulative, past = [], [0], []
        running_length = 0
        for request in scheduled_requests:
            input_ids = request.UnprocessedTokensCpu()
            ids.extend(input_ids)
            if FIXED:
                past.append(request.ProcessedSequenceLength())
            elif request.IsPrefill():
                # When a request is created, the current sequence length becomes the prompt length.
                # But the kv cache is not updated until the first token is generated.
                past.append(request.CurrentSequenceLength() - len(input_ids))
            else:
                past.append(request.CurrentSequenceLength())
            running_length += len(input_ids)
            cumulative.append(running_length)
        self.inputs_["input_ids"] = torch.tensor(ids, dtype=torch.int64)
        self.inputs_["cumulative_sequence_lengths"] = torch.tensor(cumulative, dtype=torch.int32)
        self.inputs_["past_sequence_lengths"] = torch.tensor(past, dtype=torch.int32)

    def PrepareAttentionMetadata(self, scheduled_requests):
        max_query_len = max_kv_len = 0
        for request in scheduled_requests:
            query_len = len(request.UnprocessedTokensCpu())
            if FIXED:
                kv_len = request.CurrentSequenceLength()
            else:
                kv_len = (request.CurrentSequenceLength() if request.IsPrefill()
                          else request.CurrentSequenceLength() + query_len)
            max_query_len = max(max_query_len, query_len)
            max_kv_len = max(max_kv_len, kv_len)
        self.inputs_["attention_metadata"] = torch.tensor([max_query_len, max_kv_len], dtype=torch.int32)

    def PrepareKeyValueCache(self, scheduled_requests):
        self.inputs_["block_table"] = self.cache_manager_.BlockTables(scheduled_requests)

    def ProcessInputs(self, scheduled_requests):
        self.inputs_ = {}
        self.PrepareInputIds(scheduled_requests)
        self.PrepareAttentionMetadata(scheduled_requests)
        self.PrepareKeyValueCache(scheduled_requests)
        return self.inputs_


# ---------------------------------------------------------------- the model (PagedAttention contrib op in torch)
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def PagedAttention(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
                   block_table, cos_cache, sin_cache, num_heads, kv_num_heads, scale):
    head_size = key_cache.shape[-1]
    block_size = key_cache.shape[1]
    group = num_heads // kv_num_heads
    out = torch.empty_like(query)
    for i in range(past_seqlens.shape[0]):
        start, end = int(cumulative_sequence_length[i]), int(cumulative_sequence_length[i + 1])
        q_len = end - start
        past = int(past_seqlens[i])
        total = past + q_len
        pos = past + torch.arange(q_len)
        cos, sin = cos_cache[pos][:, None, :], sin_cache[pos][:, None, :]
        q = query[start:end].view(q_len, num_heads, head_size)
        k = key[start:end].view(q_len, kv_num_heads, head_size)
        v = value[start:end].view(q_len, kv_num_heads, head_size)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        for j in range(q_len):
            slot = past + j
            blk = int(block_table[i, slot // block_size])
            key_cache[blk, slot % block_size] = k[j]
            value_cache[blk, slot % block_size] = v[j]
        slots = torch.arange(total)
        blks = block_table[i, (slots // block_size)].long()
        keys = key_cache[blks, slots % block_size].repeat_interleave(group, dim=1)  # (total, H, D)
        vals = value_cache[blks, slots % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        allowed = slots[None, :] <= pos[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, vals).reshape(q_len, -1)
    return out


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = torch.nn.LayerNorm(cfg.hidden_size)
        self.q_proj = torch.nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_size)
        self.k_proj = torch.nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_size)
        self.v_proj = torch.nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_size)
        self.o_proj = torch.nn.Linear(cfg.num_attention_heads * cfg.head_size, cfg.hidden_size)
        self.post_attention_layernorm = torch.nn.LayerNorm(cfg.hidden_size)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size), torch.nn.GELU(),
                                       torch.nn.Linear(4 * cfg.hidden_size, cfg.hidden_size))

    def forward(self, x, key_cache, value_cache, inputs, cos_cache, sin_cache):
        h = self.input_layernorm(x)
        attn = PagedAttention(self.q_proj(h), self.k_proj(h), self.v_proj(h), key_cache, value_cache,
                              inputs["cumulative_sequence_lengths"], inputs["past_sequence_lengths"],
                              inputs["block_table"], cos_cache, sin_cache, self.cfg.num_attention_heads,
                              self.cfg.num_key_value_heads, self.cfg.head_size ** -0.5)
        x = x + self.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderOnly_Model(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = torch.nn.LayerNorm(cfg.hidden_size)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_size, 2).float() / cfg.head_size))
        freqs = torch.outer(torch.arange(cfg.context_length).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos())
        self.register_buffer("sin_cache", emb.sin())

    def forward(self, inputs, cache):
        x = self.embed_tokens(inputs["input_ids"])
        for layer, (key_cache, value_cache) in zip(self.layers, cache):
            x = layer(x, key_cache, value_cache, inputs, self.cos_cache, self.sin_cache)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------- engine
class Engine:
    def __init__(self, model, cfg):
        self.model = model
        self.cache_manager = PagedKeyValueCache(cfg)
        self.decoder_io = VarlenDecoderIO(self.cache_manager)
        self.requests = []

    def AddRequest(self, request):
        request.Assign()
        self.cache_manager.Add(request)
        self.requests.append(request)

    def RemoveRequest(self, request):
        self.cache_manager.Remove(request)
        self.requests.remove(request)

    @torch.no_grad()
    def Step(self):
        scheduled = [r for r in self.requests if not r.IsDone()]
        for request in scheduled:
            self.cache_manager.AppendTokens(request)
        inputs = self.decoder_io.ProcessInputs(scheduled)
        logits = self.model(inputs, self.cache_manager.Cache())
        cumulative = inputs["cumulative_sequence_lengths"]
        for i, request in enumerate(scheduled):
            request.GenerateNextTokens(logits[int(cumulative[i + 1]) - 1])
        return logits

    def Run(self, request):
        self.AddRequest(request)
        while not request.IsDone():
            last = self.Step()
        self.RemoveRequest(request)
        return last


def main():
    model = DecoderOnly_Model(config).eval()
    engine = Engine(model, config)

    # An unrelated request runs first; its blocks go back to the pool with their KV still in them.
    y = Request([5, 17, 33, 2, 41, 8, 29, 50, 11, 3, 60, 22], max_length=20)
    engine.Run(y)

    # The request of interest, a 9-token prompt, then greedy decoding on recycled blocks.
    x = Request([7, 12, 44, 3, 19, 25, 61, 9, 30], max_length=21)
    last_logits = engine.Run(x)
    print("generated:", x.sequence[9:])
    print("last logits[:6]:", [round(v, 4) for v in last_logits[-1, :6].tolist()])


if __name__ == "__main__":
    main()
