"""ExecuTorch Qualcomm llama runner: the sliding-window mask update masked the whole cache.

Citation: pytorch/executorch#20736 (commit 4db56439a1, "Qualcomm AI Engine Direct - Fix sliding
window attention"), examples/qualcomm/oss_scripts/llama/runner/kv_manager.cpp,
``KVManager::update_attention_mask`` (the overload taking ``sliding_window``).

The runner keeps a static SMART_MASK KV cache of ``context_len - ar_len`` slots per layer and
feeds the exported static llama two precomputed mask buffers of shape [ar_len, context_len]
(``attention_mask`` for full-attention layers, ``window_attention_mask`` for sliding layers). After
every step the kv manager unmasks the ``n_update`` slots it just wrote. For the window mask, once
``n_past + n_update`` exceeds the cache the row may still see (``sliding_window - (i + 1)``) it
masks the oldest part of the row again.

The bug: it re-masked ``n_past + n_update`` cells starting at column 0, i.e. every cache slot
written so far, so past the window a sliding layer attends to the current token only.
The fix: re-mask only ``n_past + n_update - available_cache_len`` cells, the ones that fell out of
the window.

This program ports the C++ runner to Python (KVManager with the mask dtype read from the method's
input, ``fill_mask`` with the Float encoding 0 / -65535, the prompt processor and token generator
loops of the kv graph with ar_len = 1, ``update_cache`` into the SMART_MASK cache) and the
static_llama.py attention that consumes it (``attn = attn + atten_mask``; sliding layers take the
window mask), at toy sizes with random weights: 2 layers (sliding, full), sliding_window = 4,
context_len = 16.
"""

import sys
from dataclasses import dataclass, field
from typing import List

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# ---- kv_manager.cpp ----------------------------------------------------------------------------
def fill_mask(scalar_type, buf, offset, size, use_pos_value):
    """std::fill_n over a flat view of the mask buffer."""
    if size <= 0:
        return
    if use_pos_value:
        value = {torch.uint16: 65535, torch.uint8: 255, torch.float32: 0.0}[scalar_type]
    else:
        # -65535 acts as the additive "very negative" attention-mask value.
        value = {torch.uint16: 0, torch.uint8: 0, torch.float32: -65535.0}[scalar_type]
    buf[offset : offset + size] = value


@dataclass
class Metadata:
    context_len: int
    head_dim: int
    max_ar_len: int
    max_cache_len: int
    num_heads: int
    num_layers: int


@dataclass
class KVCache:
    buffer: torch.Tensor = None
    output_buffer: torch.Tensor = None


class KVManager:
    def __init__(self, metadata: Metadata, attention_mask_dtype):
        self.metadata_ = metadata
        # Result<TensorInfo> attention_mask = method_meta->input_tensor_meta(1);
        self.attention_mask_dtype_ = attention_mask_dtype
        self.k_cache_: List[KVCache] = [KVCache() for _ in range(metadata.num_layers)]
        self.v_cache_: List[KVCache] = [KVCache() for _ in range(metadata.num_layers)]

    def init_cache(self, ar_len):
        m = self.metadata_
        self.cur_ar_len_ = ar_len
        for layer in range(m.num_layers):
            # k_cache: [1, n_heads, head_dim, seq_len]; v_cache: [1, n_heads, seq_len, head_dim]
            self.k_cache_[layer].buffer = torch.zeros(1, m.num_heads, m.head_dim, m.max_cache_len)
            self.v_cache_[layer].buffer = torch.zeros(1, m.num_heads, m.max_cache_len, m.head_dim)

    def init_attention_mask(self, attention_mask, attention_map, ar_len, n_past, sliding_window=None,
                            position_offset=()):
        m = self.metadata_
        assert len(attention_map) <= ar_len
        # Clear the attention mask
        fill_mask(self.attention_mask_dtype_, attention_mask, 0, ar_len * m.context_len, False)
        # SMART_MASK requires special handling of attention mask
        past_ptr = 0
        new_ptr = m.context_len - ar_len
        # All inputs will necessarily attend to n_past and itself
        for i in range(ar_len):
            if attention_map[i] < 0:
                # If negative, attend to only past tokens
                fill_mask(self.attention_mask_dtype_, attention_mask, past_ptr, n_past, True)
            else:
                pidx = attention_map[i]
                parent_ptr = pidx * m.context_len
                attention_mask[past_ptr : past_ptr + m.context_len] = \
                    attention_mask[parent_ptr : parent_ptr + m.context_len].clone()
            # Attend to itself
            fill_mask(self.attention_mask_dtype_, attention_mask, new_ptr + i, 1, True)
            if sliding_window is not None:
                # mask by limitation of sliding_window
                available_context_len = (
                    sliding_window - (i + 1) - n_past
                    if not position_offset
                    else sliding_window - (position_offset[i] + 1) - n_past
                )
                if available_context_len < 0:
                    fill_mask(self.attention_mask_dtype_, attention_mask, past_ptr,
                              -available_context_len, False)
            past_ptr += m.context_len
            new_ptr += m.context_len

    def update_attention_mask(self, attention_mask, ar_len, n_past, n_update, sliding_window=None,
                              position_offset=()):
        m = self.metadata_
        cur_ptr = n_past
        for i in range(ar_len):
            fill_mask(self.attention_mask_dtype_, attention_mask, cur_ptr, n_update, True)
            if sliding_window is not None:
                available_cache_len = (
                    sliding_window - (i + 1)
                    if not position_offset
                    else sliding_window - (position_offset[i] + 1)
                )
                if n_past + n_update > available_cache_len:
                    if FIXED:
                        size = n_past + n_update - available_cache_len
                    else:
                        size = n_past + n_update
                    fill_mask(self.attention_mask_dtype_, attention_mask, cur_ptr - n_past, size,
                              False)
            cur_ptr += m.context_len

    def update_cache(self, ar_len, n_past, n_update, k_out, v_out):
        # SMART_MASK: the new entries are written in place at n_past
        for layer in range(self.metadata_.num_layers):
            self.k_cache_[layer].buffer[..., n_past : n_past + n_update] = k_out[layer][..., :n_update]
            self.v_cache_[layer].buffer[:, :, n_past : n_past + n_update] = v_out[layer][:, :, :n_update]


# ---- model/static_llama.py ---------------------------------------------------------------------
@dataclass
class ModelArgs:
    dim: int = 32
    n_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 64
    vocab_size: int = 64
    max_seq_len: int = 16
    sliding_window: int = 4
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.scale = float(self.head_dim) ** 0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.attn_softmax = torch.nn.Softmax(dim=-1)

    def forward(self, hidden_states, atten_mask, k_caches, v_caches):
        bsz, seq_len, _ = hidden_states.shape
        q = self.wq(hidden_states).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(hidden_states).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(hidden_states).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.transpose(2, 3)
        kh = torch.cat([k_caches, k], dim=-1)
        vh = torch.cat([v_caches, v], dim=2)
        attn = q @ kh
        attn = attn / self.scale
        attn = attn + atten_mask
        attn = self.attn_softmax(attn)
        y = attn @ vh
        y = y.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.wo(y), [k], [v]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = LlamaAttention(args)
        self.feed_forward = nn.Sequential(nn.Linear(args.dim, args.hidden_dim), nn.SiLU(),
                                          nn.Linear(args.hidden_dim, args.dim))
        self.attention_norm = nn.LayerNorm(args.dim)
        self.ffn_norm = nn.LayerNorm(args.dim)

    def forward(self, x, atten_mask, k_caches, v_caches):
        h, k, v = self.attention(self.attention_norm(x), atten_mask, k_caches, v_caches)
        h = x + h
        return h + self.feed_forward(self.ffn_norm(h)), k, v


class LlamaModelWithSlidingWindow(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_layers = len(args.layer_types)
        self.layer_types = args.layer_types
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([LlamaDecoderLayer(args) for _ in range(self.n_layers)])
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens, atten_mask, window_atten_mask, input_pos, *args):
        output_k_cache, output_v_cache = [], []
        hidden_states = self.tok_embeddings(tokens)
        for ind, decoder_layer in enumerate(self.layers):
            k_caches = args[ind]
            v_caches = args[self.n_layers + ind]
            mask = window_atten_mask if self.layer_types[ind] == "sliding_attention" else atten_mask
            hidden_states, k, v = decoder_layer(hidden_states, mask, k_caches, v_caches)
            output_k_cache.extend(k)
            output_v_cache.extend(v)
        logits = self.output(self.norm(hidden_states))
        return logits, output_k_cache, output_v_cache


# ---- runner: prompt_processor.cpp / token_generator.cpp (kv graph, ar_len = 1) ------------------
class Runner:
    def __init__(self, model: LlamaModelWithSlidingWindow, args: ModelArgs, ar_len=1):
        self.model = model
        self.ar_len = ar_len
        self.context_len = args.max_seq_len
        self.sliding_window = args.sliding_window
        metadata = Metadata(context_len=args.max_seq_len, head_dim=args.head_dim, max_ar_len=ar_len,
                            max_cache_len=args.max_seq_len - ar_len, num_heads=args.n_heads,
                            num_layers=len(args.layer_types))
        self.kv_manager_ = KVManager(metadata, attention_mask_dtype=torch.float32)
        self.kv_manager_.init_cache(ar_len)
        self.attention_mask_ = torch.empty(ar_len * self.context_len, dtype=torch.float32)
        self.window_attention_mask_ = torch.empty(ar_len * self.context_len, dtype=torch.float32)
        self.all_logits = []

    def _init_masks(self, pos):
        attention_map = list(range(-1, self.ar_len - 1))
        self.kv_manager_.init_attention_mask(self.attention_mask_, attention_map, self.ar_len, pos)
        self.kv_manager_.init_attention_mask(self.window_attention_mask_, attention_map, self.ar_len,
                                             pos, self.sliding_window)

    def _step(self, token, pos):
        kv = self.kv_manager_
        caches = [c.buffer for c in kv.k_cache_] + [c.buffer for c in kv.v_cache_]
        with torch.no_grad():
            logits, k_out, v_out = self.model(
                torch.tensor([[token]]),
                self.attention_mask_.view(1, self.ar_len, self.context_len),
                self.window_attention_mask_.view(1, self.ar_len, self.context_len),
                torch.tensor([pos], dtype=torch.int32),
                *caches,
            )
        self.all_logits.append(logits[0, -1])
        # Update KV Cache with the output results
        kv.update_cache(self.ar_len, pos, self.ar_len, k_out, v_out)
        # Update attention mask with current position
        kv.update_attention_mask(self.attention_mask_, self.ar_len, pos, self.ar_len)
        kv.update_attention_mask(self.window_attention_mask_, self.ar_len, pos, self.ar_len,
                                 self.sliding_window)
        return int(logits[0, -1].argmax())

    def prefill(self, prompt_tokens, start_pos=0):
        self._init_masks(start_pos)
        pos = start_pos
        cur_token = None
        for tok in prompt_tokens:
            cur_token = self._step(tok, pos)
            pos += 1
        return cur_token, pos

    def generate(self, cur_token, start_pos, seq_len):
        self._init_masks(start_pos)
        pos = start_pos
        out = [cur_token]
        while pos < seq_len - 1:
            cur_token = self._step(cur_token, pos)
            out.append(cur_token)
            pos += 1
        return out


def main():
    args = ModelArgs()
    model = LlamaModelWithSlidingWindow(args).eval()
    runner = Runner(model, args)
    prompt = [3, 17, 42, 8, 25, 11, 60, 5]
    cur_token, pos = runner.prefill(prompt)
    generated = runner.generate(cur_token, pos, seq_len=14)
    print("generated:", generated)
    print("last logits[:4]:", [round(x, 4) for x in runner.all_logits[-1][:4].tolist()])


if __name__ == "__main__":
    main()
