# turboderp-org/exllamav2 commit faa09e9 ("Fix learned pos emb for uneven batch", 2024-05-09).
# ExLlamaV2's batched generate_simple left-pads the prompts and hands the model a padding mask
# plus position_offsets (-padding_length per row). The rotary path used the offsets, but the
# learned positional embedding (GPTBigCode's wpe) added embedding rows past_len..past_len+q_len
# to every row, so a left-padded prompt read positions shifted by its padding length.
# Fix: per batch row, slice the embedding from past_len + position_offsets[b] (clamped at 0).
# Trimmed port of exllamav2/{tokenizer/tokenizer.py, pos_embedding.py, attn.py (Params,
# forward_torch), model.py (_forward), generator/base.py (generate_simple)} for a tiny random
# GPTBigCode-architecture model (learned positions, MQA, LayerNorm, GELU MLP, no RoPE), fp16.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ExLlamaV2Config:
    def __init__(self):
        self.vocab_size = 48
        self.hidden_size = 64
        self.num_attention_heads = 4
        self.num_key_value_heads = 1  # GPTBigCode: multi-query attention
        self.num_key_value_groups = self.num_attention_heads // self.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = 128
        self.num_hidden_layers = 2
        self.max_seq_len = 64
        self.norm_eps = 1e-5
        self.no_flash_attn = True
        self.learned_pos_emb_key = "model.wpe"


class ExLlamaV2Tokenizer:
    """Character-level stand-in with the batching methods of exllamav2's tokenizer."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2

    def encode_unspecial(self, text):
        return [3 + (ord(c) - 32) % 45 for c in text]

    def encode(self, text, add_bos=False, return_offsets=False):
        if isinstance(text, list):
            list_ids = [self.encode_unspecial(t) for t in text]
            if add_bos:
                for ids in list_ids:
                    ids.insert(0, self.bos_token_id)
            max_length = max([len(ids) for ids in list_ids])
            padded_ids = []
            offsets = []
            for ids in list_ids:
                padding_length = max_length - len(ids)
                padding = torch.full((padding_length,), self.pad_token_id)
                padded_ids.append(torch.cat((padding, torch.tensor(ids)), dim=0))
                offsets.append(-padding_length)
            stacked_ids = torch.stack(padded_ids, dim=0)
            if return_offsets:
                return stacked_ids, torch.tensor(offsets, dtype=torch.int)
            return stacked_ids
        ids = self.encode_unspecial(text)
        if add_bos:
            ids.insert(0, self.bos_token_id)
        ids = torch.tensor(ids).to(torch.long).unsqueeze(0)
        if return_offsets:
            return ids, torch.tensor([0], dtype=torch.int)
        return ids

    def padding_mask(self, ids):
        mask_bool = ids == self.pad_token_id
        mask = mask_bool.int()
        mask *= -65505 * 2
        mask = mask.half()
        return mask


class ExLlamaV2Cache:
    def __init__(self, model, batch_size=1, max_seq_len=-1):
        cfg = model.config
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len if max_seq_len != -1 else cfg.max_seq_len
        self.current_seq_len = 0
        shape = (batch_size, self.max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        self.key_states = [torch.zeros(shape, dtype=torch.float16) for _ in range(cfg.num_hidden_layers)]
        self.value_states = [torch.zeros(shape, dtype=torch.float16) for _ in range(cfg.num_hidden_layers)]

    def get_kv_state(self, layer_idx, batch_size, offset, width):
        return self.key_states[layer_idx], self.value_states[layer_idx]

    def store_kv_state(self, layer_idx, batch_size, offset, width):
        pass


class ExLlamaV2Embedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None, **kwargs):
        return self.embedding(hidden_states)


class ExLlamaV2PosEmbedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.native_ctx_size = cfg.max_seq_len
        self.embedding = nn.Embedding(self.native_ctx_size, cfg.hidden_size)

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None, **kwargs):
        if attn_params is None:
            pos_start = 0
            pos_end = hidden_states.shape[1]
            emb_slice = self.embedding.weight.data[pos_start:pos_end]
            hidden_states[:] += emb_slice

        elif not FIXED:
            if attn_params.past_len is not None:
                pos_start = attn_params.past_len
                pos_end = pos_start + attn_params.seq_len
                emb_slice = self.embedding.weight.data[pos_start:pos_end]
                hidden_states[:] += emb_slice
            else:
                assert attn_params.past_lens is not None
                for b, pl in enumerate(attn_params.past_lens):
                    pos_start = pl
                    pos_end = pos_start + attn_params.seq_len
                    emb_slice = self.embedding.weight.data[pos_start:pos_end]
                    hidden_states[b] += emb_slice

        else:
            bsz, q_len, dim = hidden_states.shape
            for b in range(bsz):
                if attn_params.past_len is not None:
                    past_len = attn_params.past_len
                else:
                    assert attn_params.past_lens is not None
                    past_len = attn_params.past_lens[b]

                if attn_params.position_offsets is not None:
                    offset = attn_params.position_offsets[b].item()
                else:
                    offset = 0

                slice_a = past_len + offset
                slice_b = past_len + q_len + offset
                assert slice_b > 0
                target_a = 0
                target_b = q_len

                if slice_a < 0:
                    target_a -= slice_a
                    slice_a = 0

                emb_slice = self.embedding.weight.data[slice_a:slice_b]
                hidden_states[b, target_a:target_b] += emb_slice

        return hidden_states


class ExLlamaV2Attention(nn.Module):
    class Params:
        def __init__(self, batch_size, seq_len, past_len, input_mask, position_offsets):
            self.batch_size = batch_size
            self.seq_len = seq_len
            if isinstance(past_len, list):
                self.past_len = None
                self.past_lens = past_len
                self.multi_cache = True
            else:
                self.past_len = past_len
                self.past_lens = None
                self.multi_cache = False
            self.input_mask = input_mask
            self.attn_mask = None
            self.position_offsets = position_offsets

        def is_causal(self):
            return self.input_mask is None

        def get_attn_mask(self, device):
            if self.attn_mask is None:
                self.attn_mask = self.build_attn_mask(device)
            return self.attn_mask

        def build_single_attn_mask(self, batch_size, seq_len, past_len, device, input_mask):
            attn_mask = torch.zeros((batch_size, 1, seq_len, past_len + seq_len), dtype=torch.float16, device=device)
            attn_mask_triu = torch.triu(torch.full((seq_len - 1, seq_len - 1), -65504.0))
            attn_mask[:, :, : seq_len - 1, past_len + 1: past_len + seq_len] = attn_mask_triu

            if input_mask is not None:
                min_mask_width = min(input_mask.shape[-1], seq_len + past_len)
                input_mask_part = input_mask[:, :min_mask_width].to(attn_mask.device)
                input_mask_part = input_mask_part.unsqueeze(1).unsqueeze(2)
                attn_mask[:, :, :, :min_mask_width] = torch.minimum(attn_mask[:, :, :, :min_mask_width], input_mask_part)

            return attn_mask

        def build_attn_mask(self, device):
            assert not self.multi_cache, "Building single mask for multiple caches"
            if self.input_mask is None and self.seq_len == 1:
                return None
            return self.build_single_attn_mask(self.batch_size, self.seq_len, self.past_len, device, self.input_mask)

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        hs, hd = cfg.hidden_size, cfg.head_dim
        self.input_layernorm = nn.LayerNorm(hs, eps=cfg.norm_eps)
        self.q_proj = nn.Linear(hs, cfg.num_attention_heads * hd)
        self.k_proj = nn.Linear(hs, cfg.num_key_value_heads * hd)
        self.v_proj = nn.Linear(hs, cfg.num_key_value_heads * hd)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, hs)

    @staticmethod
    def repeat_kv(hidden_states, n_rep):
        if n_rep == 1:
            return hidden_states
        batch, num_key_value_heads, slen, head_dim = hidden_states.shape
        hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
        return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None, **kwargs):
        cfg = self.cfg
        num_attention_heads = cfg.num_attention_heads
        num_key_value_heads = cfg.num_key_value_heads
        head_dim = cfg.head_dim

        batch_size, q_len, _ = hidden_states.size()
        past_len = 0 if cache is None else cache.current_seq_len

        residual = hidden_states
        post_norm = self.input_layernorm(hidden_states)

        query_states = self.q_proj(post_norm)
        key_states = self.k_proj(post_norm)
        value_states = self.v_proj(post_norm)

        query_states = query_states.view(batch_size, q_len, num_attention_heads, head_dim)
        key_states = key_states.view(batch_size, q_len, num_key_value_heads, head_dim)
        value_states = value_states.view(batch_size, q_len, num_key_value_heads, head_dim)

        # rope_style == RopeStyle.NONE for GPTBigCode: positions come from ExLlamaV2PosEmbedding

        if cache is not None:
            batch_keys, batch_values = cache.get_kv_state(self.layer_idx, batch_size, 0, past_len)
            new_keys = batch_keys.narrow(1, past_len, q_len).narrow(0, 0, batch_size)
            new_values = batch_values.narrow(1, past_len, q_len).narrow(0, 0, batch_size)
            new_keys.copy_(key_states)
            new_values.copy_(value_states)

            key_states = batch_keys.narrow(1, 0, past_len + q_len).narrow(0, 0, batch_size)
            value_states = batch_values.narrow(1, 0, past_len + q_len).narrow(0, 0, batch_size)

        # Torch matmul attention (no flash-attn on this machine)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        key_states = self.repeat_kv(key_states, cfg.num_key_value_groups)
        key_states = key_states.transpose(-1, -2)

        attn_weights = torch.matmul(query_states, key_states)
        attn_weights *= 1 / math.sqrt(head_dim)
        attn_mask = attn_params.get_attn_mask(hidden_states.device)
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float16)

        value_states = self.repeat_kv(value_states, cfg.num_key_value_groups)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape((batch_size, q_len, cfg.num_attention_heads * cfg.head_dim))

        if cache is not None:
            cache.store_kv_state(self.layer_idx, batch_size, past_len, q_len)

        attn_proj = self.o_proj(attn_output)
        return attn_proj + residual


class ExLlamaV2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None, **kwargs):
        residual = hidden_states
        post_norm = self.post_attention_layernorm(hidden_states)
        y = nn.functional.gelu(self.up_proj(post_norm))
        return self.down_proj(y) + residual


class ExLlamaV2Head(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, hidden_states, **kwargs):
        return self.lm_head(self.norm(hidden_states))


class ExLlamaV2(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        modules = [ExLlamaV2Embedding(config)]
        if self.config.learned_pos_emb_key:
            modules += [ExLlamaV2PosEmbedding(config)]
        for layer_idx in range(config.num_hidden_layers):
            modules += [ExLlamaV2Attention(config, layer_idx), ExLlamaV2MLP(config)]
        modules += [ExLlamaV2Head(config)]
        self.modules_ = nn.ModuleList(modules)
        self.head_layer_idx = len(modules) - 1
        self.last_kv_layer_idx = len(modules) - 3

    @torch.inference_mode()
    def forward(self, input_ids, cache=None, input_mask=None, preprocess_only=False, position_offsets=None, **kwargs):
        batch_size, seq_len = input_ids.shape
        past_len = 0
        if cache is not None:
            past_len = cache.current_seq_len

        x = input_ids
        attn_params = ExLlamaV2Attention.Params(batch_size, seq_len, past_len, input_mask, position_offsets)

        for idx, module in enumerate(self.modules_):
            x = module(x, cache=cache, attn_params=attn_params, past_len=past_len)
            if preprocess_only and idx == self.last_kv_layer_idx:
                x = None
                break

        if cache is not None:
            cache.current_seq_len += seq_len

        return x


class ExLlamaV2BaseGenerator:
    def __init__(self, model, cache, tokenizer):
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.sequence_ids = None

    def generate_simple(self, prompt, num_tokens, add_bos=False):
        stop_token = self.tokenizer.eos_token_id

        batch_size = 1 if isinstance(prompt, str) else len(prompt)
        prompts_identical = batch_size == 1 or all(s == prompt[0] for s in prompt)

        ids, position_offsets = self.tokenizer.encode(prompt, return_offsets=True, add_bos=add_bos)
        if prompts_identical:
            position_offsets = None

        mask = self.tokenizer.padding_mask(ids) if batch_size > 1 else None

        self._gen_begin_base(ids, mask, position_offsets=position_offsets)

        batch_eos = [False] * batch_size
        first_logits = None
        for i in range(num_tokens):
            logits = self.model.forward(self.sequence_ids[:, -1:],
                                        self.cache,
                                        input_mask=mask,
                                        position_offsets=position_offsets).float().cpu()
            if first_logits is None:
                first_logits = logits[:, -1]

            # ExLlamaV2Sampler with top_k = 1
            token = logits[:, -1:].argmax(dim=-1)

            for b in range(batch_size):
                if token[b, 0].item() == stop_token:
                    batch_eos[b] = True
                if batch_eos[b]:
                    token[b, 0] = self.tokenizer.pad_token_id

            self.sequence_ids = torch.cat([self.sequence_ids, token], dim=1)
            if all(batch_eos):
                break

        return self.sequence_ids[:, ids.shape[-1]:], first_logits

    def _gen_begin_base(self, input_ids, mask=None, position_offsets=None):
        self.cache.current_seq_len = 0
        self.sequence_ids = input_ids
        self.model.forward(input_ids[:, :-1],
                           self.cache,
                           input_mask=mask,
                           preprocess_only=True,
                           position_offsets=position_offsets)


def main():
    config = ExLlamaV2Config()
    model = ExLlamaV2(config).half().eval()
    tokenizer = ExLlamaV2Tokenizer()

    prompts = ["def fibonacci(n):", "x = 1"]
    cache = ExLlamaV2Cache(model, batch_size=len(prompts), max_seq_len=config.max_seq_len)
    generator = ExLlamaV2BaseGenerator(model, cache, tokenizer)
    out_ids, first_logits = generator.generate_simple(prompts, num_tokens=8, add_bos=True)

    for p, row, lg in zip(prompts, out_ids, first_logits):
        print(f"{p!r:22} -> {row.tolist()}  first-step logits[:4] {lg[:4].tolist()}")


if __name__ == "__main__":
    main()
