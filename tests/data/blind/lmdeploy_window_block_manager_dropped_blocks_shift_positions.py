# InternLM/lmdeploy#1341 ("fix window attention", commit c9f32341e). lmdeploy's PyTorch engine serves Mistral with
# a WindowBlockManager that frees the KV blocks lying wholly before the sliding window and keeps only the rest in the
# sequence's block table. Engine.create_model_inputs then took the history length of such a sequence as
# `history_len - num_drop_tokens` (the tokens still held in blocks), and built position_ids from it; StepContext.new
# derived kv_seq_length from those position_ids. Once the first block is dropped, every new token is rotated (RoPE) at
# a position `num_drop_tokens` too small, while the keys already cached keep the positions they were written with.
# The fix keeps history_lengths (and so position_ids) at the true history, passes num_blocks with the inputs, and takes
# the dropped blocks off kv_seq_length in StepContext.new instead.
import sys
from dataclasses import dataclass, field
from typing import List

import torch
from transformers import MistralConfig, MistralForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _div_up(x, n):
    """perform div up."""
    return (x + n - 1) // n


# ---------------------------------------------------------------- lmdeploy/pytorch/messages.py
@dataclass
class SchedulerSequence:
    """Scheduler message."""
    seq_id: int
    token_ids: torch.Tensor
    block_size: int
    history_token_ids: list = field(default_factory=list)
    logical_blocks: list = field(default_factory=list)

    @property
    def history_len(self) -> int:
        return len(self.history_token_ids)

    def num_all_tokens(self) -> int:
        return len(self.token_ids) + self.history_len

    def update_token_ids(self, token_ids):
        self.history_token_ids += self.token_ids.tolist()
        self.token_ids = torch.tensor([int(token_ids)])


# ---------------------------------------------------------------- paging/block_manager
class BlockAllocator:
    def __init__(self, num_blocks):
        self.free_blocks = list(range(num_blocks))

    def allocate(self, n):
        out, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return out

    def free(self, blocks):
        self.free_blocks = list(blocks) + self.free_blocks


def _last_block_size(history_len: int, block_size: int):
    last = history_len % block_size
    return last if last != 0 else block_size


def _num_blocks_to_drop(seq: SchedulerSequence, window_size: int):
    """num blocks to free."""
    if seq.history_len <= window_size:
        return 0
    block_size = seq.block_size
    history_len = seq.history_len
    num_blocks = len(seq.logical_blocks)
    win_start_block_id = (history_len - window_size) // block_size
    win_end_block_id = (history_len - 1) // block_size
    num_win_blocks = win_end_block_id - win_start_block_id + 1
    return max(0, num_blocks - num_win_blocks)


class WindowBlockManager:

    def __init__(self, num_gpu_blocks: int, window_size: int):
        self.allocator = BlockAllocator(num_gpu_blocks)
        self.window_size = window_size

    @classmethod
    def num_required_blocks(cls, seq: SchedulerSequence):
        block_size = seq.block_size
        lb_tokens = cls.last_block_size(seq)
        lb_remain_tokens = 0
        if len(seq.logical_blocks) > 0:
            lb_remain_tokens = block_size - lb_tokens
        num_input_tokens = len(seq.token_ids)
        num_req_tokens = max(0, num_input_tokens - lb_remain_tokens)
        return _div_up(num_req_tokens, block_size)

    @classmethod
    def last_block_size(cls, seq: SchedulerSequence) -> int:
        if len(seq.logical_blocks) == 0:
            return 0
        return _last_block_size(seq.history_len, seq.block_size)

    def allocate_msg(self, msg: SchedulerSequence):
        num_drop_blocks = _num_blocks_to_drop(msg, self.window_size)
        num_required_blocks = self.num_required_blocks(msg)

        droped_blocks = None
        if num_drop_blocks > 0:
            droped_blocks = msg.logical_blocks[:num_drop_blocks]
            msg.logical_blocks = msg.logical_blocks[num_drop_blocks:]

        if num_required_blocks > 0:
            if num_drop_blocks > 0:
                num_used_blocks = min(num_drop_blocks - num_required_blocks, num_required_blocks)
                if num_used_blocks > 0:
                    reused_blocks = droped_blocks[:num_used_blocks]
                else:
                    reused_blocks = droped_blocks
                msg.logical_blocks = msg.logical_blocks + list(reused_blocks)
                if num_used_blocks > 0:
                    droped_blocks = droped_blocks[num_used_blocks:]
                else:
                    num_used_blocks = num_drop_blocks
                    droped_blocks = None
                num_required_blocks = num_required_blocks - num_used_blocks
            if num_required_blocks > 0:
                msg.logical_blocks = msg.logical_blocks + self.allocator.allocate(num_required_blocks)

        if droped_blocks is not None:
            self.allocator.free(droped_blocks)

    def append_slot(self, msg):
        if self.num_required_blocks(msg) == 0:
            return
        self.allocate_msg(msg)


# ---------------------------------------------------------------- engine/model_agent.py
@dataclass
class ModelInputs:
    input_ids: torch.LongTensor
    seq_length: torch.LongTensor
    block_offsets: torch.LongTensor
    position_ids: torch.LongTensor
    q_start_loc: torch.LongTensor
    history_lengths: List[int]
    is_decoding: bool
    num_blocks: torch.LongTensor = None


@dataclass
class StepContext:
    inputs: ModelInputs
    block_offsets: torch.LongTensor
    position_ids: torch.LongTensor
    position_ids_1d: torch.LongTensor
    q_start_loc: torch.LongTensor
    q_seq_length: torch.LongTensor
    kv_seq_length: torch.LongTensor
    max_q_seq_length: int
    max_kv_seq_length: int

    @classmethod
    def new(cls, inputs: ModelInputs, cache_config=None):
        position_ids = inputs.position_ids
        max_q_seq_length = position_ids.size(-1)

        # seq_len + history_length
        kv_seq_length = position_ids[..., -1] + 1

        q_seq_length = inputs.seq_length
        if position_ids.size(1) == 1:
            position_ids_1d = position_ids.flatten()
        else:
            position_ids_1d = torch.cat([ids[:l] for ids, l in zip(position_ids, q_seq_length)])

        max_kv_seq_length = max_q_seq_length + max(inputs.history_lengths)

        if FIXED:
            window_size = getattr(cache_config, 'window_size', 0)
            if window_size > 0:
                block_size = cache_config.block_size
                expected_num_blocks = _div_up(kv_seq_length, block_size)
                missed_num_blocks = expected_num_blocks - inputs.num_blocks
                kv_seq_length = kv_seq_length - missed_num_blocks * block_size

        return StepContext(inputs=inputs, block_offsets=inputs.block_offsets, position_ids=position_ids,
                           position_ids_1d=position_ids_1d, q_start_loc=inputs.q_start_loc,
                           q_seq_length=q_seq_length, kv_seq_length=kv_seq_length,
                           max_q_seq_length=max_q_seq_length, max_kv_seq_length=max_kv_seq_length)


@dataclass
class CacheConfig:
    block_size: int
    num_gpu_blocks: int
    window_size: int = 0


# ---------------------------------------------------------------- kernels (torch ports of the triton kernels)
def fill_kv_cache(k_states, v_states, k_caches, v_caches, q_start_loc, q_seq_length, kv_seq_length,
                  max_q_seq_length, block_offsets):
    """fill key/value state to cache for paged attention."""
    block_size = k_caches.size(1)
    for b in range(block_offsets.size(0)):
        q_seqlen = int(q_seq_length[b])
        history_seqlen = int(kv_seq_length[b]) - q_seqlen
        start = int(q_start_loc[b])
        for i in range(q_seqlen):
            loc = history_seqlen + i
            block_off = int(block_offsets[b, loc // block_size])
            k_caches[block_off, loc % block_size] = k_states[start + i]
            v_caches[block_off, loc % block_size] = v_states[start + i]


def paged_attention_fwd(q, k, v, o, block_offsets, q_start_loc, q_seqlens, kv_seqlens, max_seqlen,
                        window_size=-1):
    """Paged Attention forward (the _fwd_kernel's masking, one sequence at a time)."""
    block_size = k.size(1)
    num_heads, head_dim = q.size(1), q.size(2)
    kv_group_num = num_heads // k.size(2)
    sm_scale = 1.0 / head_dim ** 0.5
    for b in range(block_offsets.size(0)):
        q_seqlen, kv_seqlen = int(q_seqlens[b]), int(kv_seqlens[b])
        start = int(q_start_loc[b])
        history_len = kv_seqlen - q_seqlen
        locs = torch.arange(kv_seqlen)
        phys = block_offsets[b, locs // block_size]
        keys = k[phys, locs % block_size].repeat_interleave(kv_group_num, 1)  # (kv, h, d)
        vals = v[phys, locs % block_size].repeat_interleave(kv_group_num, 1)
        qb = q[start:start + q_seqlen]
        qk = torch.einsum('mhd,nhd->hmn', qb.float(), keys.float()) * sm_scale
        offs_m = torch.arange(q_seqlen)
        qk_mask = (history_len + offs_m[:, None]) >= locs[None, :]
        if window_size > 0:
            kv_min_loc = torch.clamp(history_len + offs_m - window_size, min=0)
            qk_mask = qk_mask & (locs[None, :] >= kv_min_loc[:, None])
        qk = torch.where(qk_mask, qk, torch.tensor(-1e30))
        p = torch.softmax(qk, dim=-1)
        o[start:start + q_seqlen] = torch.einsum('hmn,nhd->mhd', p, vals.float()).to(o.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids_1d):
    cos = cos[position_ids_1d][:, None, :]
    sin = sin[position_ids_1d][:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding:
    def __init__(self, dim, base):
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))

    def __call__(self, x, seq_len):
        t = torch.arange(seq_len).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


# ---------------------------------------------------------------- models/mistral.py (patched forward)
class PatchedMistral:

    def __init__(self, hf_model: MistralForCausalLM):
        self.hf = hf_model
        self.config = hf_model.config
        cfg = self.config
        self.head_dim = getattr(cfg, 'head_dim', None) or cfg.hidden_size // cfg.num_attention_heads
        rope_parameters = getattr(cfg, 'rope_parameters', None) or {}
        base = rope_parameters.get('rope_theta', getattr(cfg, 'rope_theta', 10000.0))
        self.rotary_emb = RotaryEmbedding(self.head_dim, base)

    def attention(self, attn, hidden_states, past_key_value, context):
        cfg = self.config
        num_heads, num_kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim
        query_states = attn.q_proj(hidden_states).view(-1, num_heads, head_dim)
        key_states = attn.k_proj(hidden_states).view(-1, num_kv_heads, head_dim)
        value_states = attn.v_proj(hidden_states).view(-1, num_kv_heads, head_dim)

        cos, sin = self.rotary_emb(value_states, seq_len=context.max_kv_seq_length)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin,
                                                        context.position_ids_1d)

        fill_kv_cache(key_states, value_states, past_key_value[0], past_key_value[1], context.q_start_loc,
                      context.q_seq_length, kv_seq_length=context.kv_seq_length,
                      max_q_seq_length=context.max_q_seq_length, block_offsets=context.block_offsets)

        attn_output = torch.empty_like(query_states)
        window_size = self.config.sliding_window
        paged_attention_fwd(query_states, past_key_value[0], past_key_value[1], attn_output,
                            context.block_offsets, q_start_loc=context.q_start_loc,
                            q_seqlens=context.q_seq_length, kv_seqlens=context.kv_seq_length,
                            max_seqlen=context.max_q_seq_length, window_size=window_size)
        return attn.o_proj(attn_output.reshape(-1, num_heads * head_dim))

    @torch.no_grad()
    def forward(self, input_ids, context, kv_caches):
        model = self.hf.model
        hidden = model.embed_tokens(input_ids[0])
        for layer, past_key_value in zip(model.layers, kv_caches):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            hidden = residual + self.attention(layer.self_attn, hidden, past_key_value, context)
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = model.norm(hidden)
        return self.hf.lm_head(hidden)


# ---------------------------------------------------------------- engine/engine.py
class Engine:

    def __init__(self, model: PatchedMistral, cache_config: CacheConfig):
        self.model = model
        self.model_config = model.config
        self.cache_config = cache_config
        self.block_manager = WindowBlockManager(cache_config.num_gpu_blocks, cache_config.window_size)
        cfg = model.config
        head_dim = model.head_dim
        self.kv_caches = [(torch.zeros(cache_config.num_gpu_blocks, cache_config.block_size,
                                       cfg.num_key_value_heads, head_dim),
                           torch.zeros(cache_config.num_gpu_blocks, cache_config.block_size,
                                       cfg.num_key_value_heads, head_dim))
                          for _ in range(cfg.num_hidden_layers)]

    def create_model_inputs(self, messages: List[SchedulerSequence]):

        def __get_history_length():
            """get history length."""
            if self.model_config.sliding_window > 0:
                history_lengths = []
                for msg in messages:
                    num_real_blocks = len(msg.logical_blocks)
                    num_all_blocks = _div_up(msg.num_all_tokens(), msg.block_size)
                    num_drop_blocks = num_all_blocks - num_real_blocks
                    num_drop_tokens = num_drop_blocks * msg.block_size
                    history_lengths.append(msg.history_len - num_drop_tokens)
                return history_lengths
            else:
                return [msg.history_len for msg in messages]

        if FIXED:
            history_lengths = [msg.history_len for msg in messages]
        else:
            history_lengths = __get_history_length()

        token_ids = [msg.token_ids for msg in messages]
        batch_size = len(messages)
        input_ids = torch.cat(token_ids)

        seq_length = torch.tensor([tokens.size(0) for tokens in token_ids], dtype=torch.long)
        is_decoding = input_ids.size(0) == batch_size
        q_start_loc = seq_length.cumsum(0) - seq_length
        if not is_decoding:
            max_seq_len = max(seq_length)
            mask_range = torch.arange(max_seq_len)[None, :]
            attention_mask = (mask_range < seq_length[:, None]).long()
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids += position_ids.new_tensor(history_lengths).unsqueeze(-1)
        else:
            position_ids = q_start_loc.new_tensor(history_lengths).unsqueeze(-1)

        block_tables = [msg.logical_blocks for msg in messages]
        num_blocks = torch.tensor([len(boff) for boff in block_tables])
        max_len = max(len(b) for b in block_tables)
        block_offsets = torch.zeros(batch_size, max_len, dtype=torch.long)
        for i, b in enumerate(block_tables):
            block_offsets[i, :len(b)] = torch.tensor(b)

        return ModelInputs(input_ids=input_ids.unsqueeze(0), seq_length=seq_length, block_offsets=block_offsets,
                           position_ids=position_ids, q_start_loc=q_start_loc, history_lengths=history_lengths,
                           is_decoding=is_decoding, num_blocks=num_blocks)

    def step(self, messages):
        for msg in messages:
            self.block_manager.append_slot(msg)
        inputs = self.create_model_inputs(messages)
        context = StepContext.new(inputs, cache_config=self.cache_config)
        logits = self.model.forward(inputs.input_ids, context, self.kv_caches)
        last = context.q_start_loc + context.q_seq_length - 1
        return logits[last]


def main():
    config = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           max_position_embeddings=128, rope_theta=100.0)
    hf_model = MistralForCausalLM(config).eval()
    with torch.no_grad():  # stand-in for a converted checkpoint: N(0, initializer_range) matrices
        for param in hf_model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, config.initializer_range)
    model = PatchedMistral(hf_model)
    cache_config = CacheConfig(block_size=4, num_gpu_blocks=32, window_size=config.sliding_window)
    engine = Engine(model, cache_config)

    prompts = [[5, 17, 42, 8, 23, 61], [3, 90, 11, 7, 54, 29, 33, 71, 12]]
    messages = [SchedulerSequence(seq_id=i, token_ids=torch.tensor(p), block_size=cache_config.block_size)
                for i, p in enumerate(prompts)]

    generated = [[] for _ in messages]
    last_logits = None
    # prefill each prompt, then decode both together
    for i, msg in enumerate(messages):
        logits = engine.step([msg])
        tok = int(logits[0].argmax())
        generated[i].append(tok)
        msg.update_token_ids(tok)
    for _ in range(20):
        logits = engine.step(messages)
        last_logits = logits
        for i, msg in enumerate(messages):
            tok = int(logits[i].argmax())
            generated[i].append(tok)
            msg.update_token_ids(tok)

    for i, msg in enumerate(messages):
        print(f"seq {i}: history_len={msg.history_len} blocks held={len(msg.logical_blocks)} "
              f"generated={generated[i]}")
    print("last-step logits sum per seq:", [round(float(x), 4) for x in last_logits.sum(-1)])


if __name__ == "__main__":
    main()
