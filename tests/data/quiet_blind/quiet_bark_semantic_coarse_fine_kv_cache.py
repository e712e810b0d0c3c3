"""Bark's three GPT stages (semantic, coarse, fine), ported small from suno-ai/bark.

Citation: suno-ai/bark
  bark/model.py       (CausalSelfAttention, Block, GPT.forward with merge_context / past_kv)
  bark/model_fine.py  (NonCausalSelfAttention, FineGPT.forward)
  bark/generation.py  (generate_text_semantic, generate_coarse, generate_fine)

Masking as Bark does it:
  * semantic / coarse: causal self-attention.  The SDPA ("flash") path calls
    scaled_dot_product_attention(is_causal=True) on the prefill and is_causal=False on a
    cached step (one query that may see every cached key).  The manual path keeps a
    tril(block_size) buffer and slices it as bias[:, :, FULL_T - T:FULL_T, :FULL_T], so the
    rows line up with the cache offset.
  * the text (right-padded with TEXT_PAD_TOKEN) and the semantic history (right-padded with
    SEMANTIC_PAD_TOKEN) are fixed-length context blocks that the model was trained to read as
    tokens (no attention mask by design); merge_context sums the two blocks' embeddings.
  * coarse: a sliding window; the kv cache is dropped at every new window.
  * fine: non-causal attention over a fixed 1024-frame buffer (here 32) padded with the
    CODEBOOK_SIZE token, as Bark's fine model is trained.

Sizes are shrunk (256 -> CTX=16, 1024 -> 32 ...).  Sampling is replaced by argmax so that the
runs can be compared.  Checks: cached decoding == uncached decoding, SDPA path == manual path,
and every step's logits == an independent per-query loop over the whole final sequence.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

torch.manual_seed(0)
np.random.seed(0)

# ---------------------------------------------------------------- tiny constants
CTX = 16                      # 256 in Bark
CODEBOOK_SIZE = 16            # 1024
SEMANTIC_VOCAB_SIZE = 40      # 10_000
SEMANTIC_PAD_TOKEN = 40       # 10_000
TEXT_ENCODING_OFFSET = 48     # 10_048
N_TEXT = 24
TEXT_PAD_TOKEN = TEXT_ENCODING_OFFSET + N_TEXT        # 129_595
SEMANTIC_INFER_TOKEN = TEXT_PAD_TOKEN + 1             # 129_599
N_COARSE_CODEBOOKS = 2
N_FINE_CODEBOOKS = 4          # 8
COARSE_RATE_HZ = 75
SEMANTIC_RATE_HZ = 49.9
COARSE_SEMANTIC_PAD_TOKEN = SEMANTIC_VOCAB_SIZE + N_COARSE_CODEBOOKS * CODEBOOK_SIZE  # 12_048
COARSE_INFER_TOKEN = COARSE_SEMANTIC_PAD_TOKEN + 2                                  # 12_050
FINE_BLOCK = 32               # 1024
FINE_HOP = 16                 # 512


# ---------------------------------------------------------------- bark/model.py
class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention") and config.use_flash
        if not self.flash:
            self.register_buffer(
                "bias",
                torch.tril(torch.ones(config.block_size, config.block_size)).view(
                    1, 1, config.block_size, config.block_size
                ),
            )

    def forward(self, x, past_kv=None, use_cache=False):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

        if past_kv is not None:
            past_key = past_kv[0]
            past_value = past_kv[1]
            k = torch.cat((past_key, k), dim=-2)
            v = torch.cat((past_value, v), dim=-2)

        FULL_T = k.shape[-2]

        if use_cache is True:
            present = (k, v)
        else:
            present = None

        if self.flash:
            if past_kv is not None:
                # the last query can attend to every previous key/value
                is_causal = False
            else:
                is_causal = True
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout, is_causal=is_causal
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, FULL_T - T:FULL_T, :FULL_T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return (y, present)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.gelu = nn.GELU()

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.layer_idx = layer_idx

    def forward(self, x, past_kv=None, use_cache=False):
        attn_output, prev_kvs = self.attn(self.ln_1(x), past_kv=past_kv, use_cache=use_cache)
        x = x + attn_output
        x = x + self.mlp(self.ln_2(x))
        return (x, prev_kvs)


@dataclass
class GPTConfig:
    block_size: int = 64
    input_vocab_size: int = 80
    output_vocab_size: int = 80
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    use_flash: bool = True


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.input_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, idx) for idx in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.output_vocab_size, bias=False)

    def forward(self, idx, merge_context=False, past_kv=None, position_ids=None, use_cache=False):
        device = idx.device
        b, t = idx.size()
        if past_kv is not None:
            assert t == 1
            tok_emb = self.transformer.wte(idx)
        else:
            if merge_context:
                assert idx.shape[1] >= CTX + CTX + 1
                t = idx.shape[1] - CTX
            else:
                assert t <= self.config.block_size
            if merge_context:
                tok_emb = torch.cat(
                    [
                        self.transformer.wte(idx[:, :CTX]) + self.transformer.wte(idx[:, CTX:CTX + CTX]),
                        self.transformer.wte(idx[:, CTX + CTX:]),
                    ],
                    dim=1,
                )
            else:
                tok_emb = self.transformer.wte(idx)

        if past_kv is None:
            past_length = 0
            past_kv = tuple([None] * len(self.transformer.h))
        else:
            past_length = past_kv[0][0].size(-2)

        if position_ids is None:
            position_ids = torch.arange(past_length, t + past_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0)
            assert position_ids.shape == (1, t)

        pos_emb = self.transformer.wpe(position_ids)
        x = self.transformer.drop(tok_emb + pos_emb)
        new_kv = () if use_cache else None
        for i, (block, past_layer_kv) in enumerate(zip(self.transformer.h, past_kv)):
            x, kv = block(x, past_kv=past_layer_kv, use_cache=use_cache)
            if use_cache:
                new_kv = new_kv + (kv,)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x[:, [-1], :])
        return (logits, new_kv)


# ---------------------------------------------------------------- bark/model_fine.py
class NonCausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = (
            hasattr(torch.nn.functional, "scaled_dot_product_attention")
            and self.dropout == 0.0
            and config.use_flash
        )

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout, is_causal=False
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class FineBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = NonCausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class FineGPTConfig(GPTConfig):
    n_codes_total: int = N_FINE_CODEBOOKS
    n_codes_given: int = 1


class FineGPT(GPT):
    def __init__(self, config):
        super().__init__(config)
        del self.lm_head
        self.n_codes_total = config.n_codes_total
        self.transformer = nn.ModuleDict(
            dict(
                wtes=nn.ModuleList(
                    [nn.Embedding(config.input_vocab_size, config.n_embd) for _ in range(config.n_codes_total)]
                ),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([FineBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_heads = nn.ModuleList(
            [
                nn.Linear(config.n_embd, config.output_vocab_size, bias=False)
                for _ in range(config.n_codes_given, self.n_codes_total)
            ]
        )
        for i in range(self.n_codes_total - config.n_codes_given):
            self.transformer.wtes[i + 1].weight = self.lm_heads[i].weight

    def forward(self, pred_idx, idx):
        device = idx.device
        b, t, codes = idx.size()
        assert t <= self.config.block_size
        assert pred_idx > 0
        assert codes == self.n_codes_total
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0)
        tok_embs = [wte(idx[:, :, i]).unsqueeze(-1) for i, wte in enumerate(self.transformer.wtes)]
        tok_emb = torch.cat(tok_embs, dim=-1)
        pos_emb = self.transformer.wpe(pos)
        x = tok_emb[:, :, :, : pred_idx + 1].sum(dim=-1)
        x = self.transformer.drop(x + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_heads[pred_idx - self.config.n_codes_given](x)


# ---------------------------------------------------------------- bark/generation.py (greedy)
def generate_text_semantic(model, encoded_text, semantic_history, n_tot_steps, use_kv_caching):
    encoded_text = np.array(encoded_text) + TEXT_ENCODING_OFFSET
    encoded_text = encoded_text[:CTX]
    encoded_text = np.pad(
        encoded_text, (0, CTX - len(encoded_text)), constant_values=TEXT_PAD_TOKEN, mode="constant"
    )
    if semantic_history is not None:
        semantic_history = semantic_history.astype(np.int64)[-CTX:]
        semantic_history = np.pad(
            semantic_history, (0, CTX - len(semantic_history)),
            constant_values=SEMANTIC_PAD_TOKEN, mode="constant",
        )
    else:
        semantic_history = np.array([SEMANTIC_PAD_TOKEN] * CTX)
    x = torch.from_numpy(
        np.hstack([encoded_text, semantic_history, np.array([SEMANTIC_INFER_TOKEN])]).astype(np.int64)
    )[None]
    assert x.shape[1] == CTX + CTX + 1
    step_logits = []
    kv_cache = None
    with torch.inference_mode():
        for n in range(n_tot_steps):
            if use_kv_caching and kv_cache is not None:
                x_input = x[:, [-1]]
            else:
                x_input = x
            logits, kv_cache = model(x_input, merge_context=True, use_cache=use_kv_caching, past_kv=kv_cache)
            step_logits.append(logits[0, 0].clone())
            relevant_logits = logits[0, 0, :SEMANTIC_VOCAB_SIZE]
            relevant_logits = torch.hstack((relevant_logits, logits[0, 0, [SEMANTIC_PAD_TOKEN]]))
            item_next = torch.argmax(relevant_logits, dim=-1, keepdim=True)
            if item_next == SEMANTIC_VOCAB_SIZE:
                item_next = torch.tensor([0])  # keep going (no early stop in this test)
            x = torch.cat((x, item_next[None]), dim=1)
    out = x.detach().cpu().numpy().squeeze()[CTX + CTX + 1:]
    return out, x, torch.stack(step_logits)


def generate_coarse(model, x_semantic, max_coarse_history, sliding_window_len, use_kv_caching):
    semantic_to_coarse_ratio = COARSE_RATE_HZ / SEMANTIC_RATE_HZ * N_COARSE_CODEBOOKS
    max_semantic_history = int(np.floor(max_coarse_history / semantic_to_coarse_ratio))
    x_semantic_history = np.array([], dtype=np.int32)
    x_coarse_history = np.array([], dtype=np.int32)
    n_steps = int(
        round(np.floor(len(x_semantic) * semantic_to_coarse_ratio / N_COARSE_CODEBOOKS) * N_COARSE_CODEBOOKS)
    )
    assert n_steps > 0 and n_steps % N_COARSE_CODEBOOKS == 0
    x_semantic = np.hstack([x_semantic_history, x_semantic]).astype(np.int32)
    x_coarse = x_coarse_history.astype(np.int32)
    base_semantic_idx = len(x_semantic_history)
    windows = []  # (final window input ids, logits per step, first step index within window)
    with torch.inference_mode():
        x_semantic_in = torch.from_numpy(x_semantic)[None].long()
        x_coarse_in = torch.from_numpy(x_coarse)[None].long()
        n_window_steps = int(np.ceil(n_steps / sliding_window_len))
        n_step = 0
        for _ in range(n_window_steps):
            semantic_idx = base_semantic_idx + int(round(n_step / semantic_to_coarse_ratio))
            x_in = x_semantic_in[:, np.max([0, semantic_idx - max_semantic_history]):]
            x_in = x_in[:, :CTX]
            x_in = F.pad(x_in, (0, CTX - x_in.shape[-1]), "constant", COARSE_SEMANTIC_PAD_TOKEN)
            x_in = torch.hstack(
                [x_in, torch.tensor([COARSE_INFER_TOKEN])[None], x_coarse_in[:, -max_coarse_history:]]
            )
            start_len = x_in.shape[1]
            kv_cache = None
            logits_this_window = []
            for _ in range(sliding_window_len):
                if n_step >= n_steps:
                    continue
                is_major_step = n_step % N_COARSE_CODEBOOKS == 0
                if use_kv_caching and kv_cache is not None:
                    x_input = x_in[:, [-1]]
                else:
                    x_input = x_in
                logits, kv_cache = model(x_input, use_cache=use_kv_caching, past_kv=kv_cache)
                logits_this_window.append(logits[0, 0].clone())
                logit_start_idx = SEMANTIC_VOCAB_SIZE + (1 - int(is_major_step)) * CODEBOOK_SIZE
                logit_end_idx = SEMANTIC_VOCAB_SIZE + (2 - int(is_major_step)) * CODEBOOK_SIZE
                relevant_logits = logits[0, 0, logit_start_idx:logit_end_idx]
                item_next = torch.argmax(relevant_logits, dim=-1, keepdim=True)
                item_next += logit_start_idx
                x_coarse_in = torch.cat((x_coarse_in, item_next[None]), dim=1)
                x_in = torch.cat((x_in, item_next[None]), dim=1)
                n_step += 1
            windows.append((x_in.clone(), torch.stack(logits_this_window), start_len))
    gen_coarse_arr = x_coarse_in.detach().cpu().numpy().squeeze()[len(x_coarse_history):]
    assert len(gen_coarse_arr) == n_steps
    gen_coarse_audio_arr = gen_coarse_arr.reshape(-1, N_COARSE_CODEBOOKS).T - SEMANTIC_VOCAB_SIZE
    for n in range(1, N_COARSE_CODEBOOKS):
        gen_coarse_audio_arr[n, :] -= n * CODEBOOK_SIZE
    return gen_coarse_audio_arr, windows


def generate_fine(model, x_coarse_gen):
    n_coarse = x_coarse_gen.shape[0]
    in_arr = np.vstack(
        [x_coarse_gen, np.zeros((N_FINE_CODEBOOKS - n_coarse, x_coarse_gen.shape[1])) + CODEBOOK_SIZE]
    ).astype(np.int32)
    n_history = 0
    n_remove_from_end = 0
    if in_arr.shape[1] < FINE_BLOCK:
        n_remove_from_end = FINE_BLOCK - in_arr.shape[1]
        in_arr = np.hstack(
            [in_arr, np.zeros((N_FINE_CODEBOOKS, n_remove_from_end), dtype=np.int32) + CODEBOOK_SIZE]
        )
    n_loops = np.max([0, int(np.ceil((x_coarse_gen.shape[1] - (FINE_BLOCK - n_history)) / FINE_HOP))]) + 1
    calls = []
    with torch.inference_mode():
        in_arr = torch.tensor(in_arr.T).long()
        for n in range(n_loops):
            start_idx = np.min([n * FINE_HOP, in_arr.shape[0] - FINE_BLOCK])
            start_fill_idx = np.min([n_history + n * FINE_HOP, in_arr.shape[0] - FINE_HOP])
            rel_start_fill_idx = start_fill_idx - start_idx
            in_buffer = in_arr[start_idx:start_idx + FINE_BLOCK, :][None].clone()
            for nn_ in range(n_coarse, N_FINE_CODEBOOKS):
                logits = model(nn_, in_buffer)
                calls.append((nn_, in_buffer.clone(), logits.clone()))
                relevant_logits = logits[0, rel_start_fill_idx:, :CODEBOOK_SIZE]
                codebook_preds = torch.argmax(relevant_logits, -1)
                in_buffer[0, rel_start_fill_idx:, nn_] = codebook_preds
            for nn_ in range(n_coarse, N_FINE_CODEBOOKS):
                in_arr[start_fill_idx:start_fill_idx + (FINE_BLOCK - rel_start_fill_idx), nn_] = in_buffer[
                    0, rel_start_fill_idx:, nn_
                ]
        gen_fine_arr = in_arr.detach().cpu().numpy().squeeze().T
    if n_remove_from_end > 0:
        gen_fine_arr = gen_fine_arr[:, :-n_remove_from_end]
    assert gen_fine_arr.shape[-1] == x_coarse_gen.shape[-1]
    return gen_fine_arr, calls


# ---------------------------------------------------------------- independent reference
def ref_hidden(blocks, x, causal):
    """Plain loops: for each layer, each head, each query i, softmax over keys 0..i (or all)."""
    T = x.shape[0]
    for blk in blocks:
        attn = blk.attn
        h = blk.ln_1(x[None])[0]
        qkv = attn.c_attn(h)
        q, k, v = qkv.split(attn.n_embd, dim=-1)
        hs = attn.n_embd // attn.n_head
        out = torch.zeros(T, attn.n_embd)
        for hd in range(attn.n_head):
            sl = slice(hd * hs, (hd + 1) * hs)
            for i in range(T):
                last = i + 1 if causal else T
                s = (k[:last, sl] @ q[i, sl]) / math.sqrt(hs)
                p = torch.softmax(s, dim=0)
                out[i, sl] = p @ v[:last, sl]
        x = x + attn.c_proj(out)
        x = x + blk.mlp(blk.ln_2(x[None])[0])
    return x


def ref_gpt_all_logits(model, idx, merge_context):
    with torch.inference_mode():
        wte = model.transformer.wte
        if merge_context:
            emb = torch.cat([wte(idx[:CTX]) + wte(idx[CTX:2 * CTX]), wte(idx[2 * CTX:])], dim=0)
        else:
            emb = wte(idx)
        x = emb + model.transformer.wpe(torch.arange(emb.shape[0]))
        x = ref_hidden(model.transformer.h, x, causal=True)
        x = model.transformer.ln_f(x[None])[0]
        return model.lm_head(x)


def ref_fine_logits(model, pred_idx, idx):
    with torch.inference_mode():
        t = idx.shape[0]
        x = sum(model.transformer.wtes[i](idx[:, i]) for i in range(pred_idx + 1))
        x = x + model.transformer.wpe(torch.arange(t))
        x = ref_hidden(model.transformer.h, x, causal=False)
        x = model.transformer.ln_f(x)
        return model.lm_heads[pred_idx - model.config.n_codes_given](x)


def twin(cls, cfg_cls, src, **kw):
    m = cls(cfg_cls(use_flash=False, **kw)).eval()
    missing, unexpected = m.load_state_dict(src.state_dict(), strict=False)
    assert not unexpected and all(n.endswith("attn.bias") for n in missing), (missing, unexpected)
    return m


def main():
    ok = True
    tol = dict(atol=1e-4, rtol=1e-4)

    # ---- semantic stage
    sem_kw = dict(block_size=64, input_vocab_size=SEMANTIC_INFER_TOKEN + 1,
                  output_vocab_size=TEXT_ENCODING_OFFSET)
    semantic = GPT(GPTConfig(**sem_kw)).eval()
    semantic_manual = twin(GPT, GPTConfig, semantic, **sem_kw)
    text = np.random.randint(0, N_TEXT, size=11)            # 11 of CTX=16 slots, rest TEXT_PAD_TOKEN
    history = np.random.randint(0, SEMANTIC_VOCAB_SIZE, size=6)  # 6 of 16, rest SEMANTIC_PAD_TOKEN
    n_sem = 20
    out_c, x_c, lg_c = generate_text_semantic(semantic, text, history, n_sem, use_kv_caching=True)
    out_u, x_u, lg_u = generate_text_semantic(semantic, text, history, n_sem, use_kv_caching=False)
    out_m, x_m, lg_m = generate_text_semantic(semantic_manual, text, history, n_sem, use_kv_caching=True)
    ref = ref_gpt_all_logits(semantic, x_c[0], merge_context=True)
    ref_steps = ref[CTX:CTX + n_sem]  # merged position CTX is the infer token -> first step
    r = {
        "semantic cached == uncached tokens": np.array_equal(out_c, out_u),
        "semantic SDPA == manual tril-slice tokens": np.array_equal(out_c, out_m),
        "semantic cached step logits == per-query loop": torch.allclose(lg_c, ref_steps, **tol),
        "semantic manual cached logits == per-query loop": torch.allclose(lg_m, ref_steps, **tol),
        "semantic uncached logits == per-query loop": torch.allclose(lg_u, ref_steps, **tol),
    }

    # ---- coarse stage
    co_kw = dict(block_size=64, input_vocab_size=COARSE_INFER_TOKEN + 1,
                 output_vocab_size=COARSE_SEMANTIC_PAD_TOKEN)
    coarse = GPT(GPTConfig(**co_kw)).eval()
    coarse_manual = twin(GPT, GPTConfig, coarse, **co_kw)
    x_semantic = out_c[:10].astype(np.int64)
    max_hist, win = 12, 6
    assert max_hist + win <= 64 - CTX
    co_c, w_c = generate_coarse(coarse, x_semantic, max_hist, win, use_kv_caching=True)
    co_u, w_u = generate_coarse(coarse, x_semantic, max_hist, win, use_kv_caching=False)
    co_m, w_m = generate_coarse(coarse_manual, x_semantic, max_hist, win, use_kv_caching=True)
    coarse_ref_ok = True
    for (x_in, lgs, start_len), (_, lgs_m, _) in zip(w_c, w_m):
        ref = ref_gpt_all_logits(coarse, x_in[0], merge_context=False)
        ref_steps = ref[start_len - 1:start_len - 1 + lgs.shape[0]]
        coarse_ref_ok &= torch.allclose(lgs, ref_steps, **tol) and torch.allclose(lgs_m, ref_steps, **tol)
    r["coarse cached == uncached codes"] = np.array_equal(co_c, co_u)
    r["coarse SDPA == manual codes"] = np.array_equal(co_c, co_m)
    r["coarse windows' step logits == per-query loop"] = bool(coarse_ref_ok)
    r["coarse used >1 window (cache reset)"] = len(w_c) > 1

    # ---- fine stage
    fi_kw = dict(block_size=FINE_BLOCK, input_vocab_size=CODEBOOK_SIZE + 1, output_vocab_size=CODEBOOK_SIZE + 1)
    fine = FineGPT(FineGPTConfig(**fi_kw)).eval()
    fine_manual = twin(FineGPT, FineGPTConfig, fine, **fi_kw)
    # fine on a longer coarse array than the buffer (several loops) and a shorter one (end padding)
    long_coarse = np.random.randint(0, CODEBOOK_SIZE, size=(N_COARSE_CODEBOOKS, 45))
    fine_ok = True
    for xc in (co_c, long_coarse):
        f_a, calls = generate_fine(fine, xc.copy())
        f_b, calls_m = generate_fine(fine_manual, xc.copy())
        fine_ok &= np.array_equal(f_a, f_b)
        for (pi, buf, lg), (_, _, lg_m) in zip(calls, calls_m):
            ref = ref_fine_logits(fine, pi, buf[0])
            fine_ok &= torch.allclose(lg[0], ref, **tol) and torch.allclose(lg_m[0], ref, **tol)
        fine_ok &= np.array_equal(f_a[:N_COARSE_CODEBOOKS], xc)
    r["fine SDPA == manual == per-query loop (short and long inputs)"] = bool(fine_ok)

    for k, v in r.items():
        print(f"{k}: {'match' if v else 'MISMATCH'}")
        ok &= bool(v)
    print("ALL MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
