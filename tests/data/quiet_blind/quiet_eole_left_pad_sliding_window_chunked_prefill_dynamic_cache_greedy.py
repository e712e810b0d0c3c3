# Citation: eole-nlp/eole @ce7139c3151264cc3ad052f33609472c22b24a5b
#   eole/decoders/transformer.py (TransformerDecoder.forward / _forward_chunked_prefill / _forward_eager /
#   _chunk_attn_mask / _init_cache / _extend_cache / _disable_cache, TransformerDecoderLayer._forward_eager /
#   _forward_no_cross_attn), eole/modules/multi_headed_attn.py (SelfMHA.forward / _update_cache_w_inputs,
#   MultiHeadedAttention._prepare_inputs / _compute_attention, manual path taken on CPU), eole/modules/rope.py
#   (RotaryPosition.forward_1d / update, apply_rotary_emb, non-interleaved), eole/predict/generator.py
#   (the step loop of _translate_batch_with_strategy with left_pad batches) and eole/predict/inference.py
#   (_decode_and_generate: tgt_pad_mask = decoder_in.eq(pad), _init_cache at step 0).
# Correct program: a Mistral-style decoder-only LM (RoPE, GQA, RMSNorm, gated SiLU MLP, sliding_window = 4)
# generates greedily for a left-padded batch through eole's hand-written KV-cache loop with dynamic shapes. The
# prompt is longer than the window, so the prefill runs in window-sized chunks, each with an absolute-position
# mask (causal, window, left padding from _init_cache); a one-token chunk and every decode step use the
# position_indices mask; the cache grows by 32 slots when full. Every prompt's generated tokens and per-step
# log-probs are checked against that prompt alone, unpadded, run with no cache through a reference forward that
# slices each query's window of keys by hand (no mask).
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.functional import log_softmax

torch.manual_seed(3)


# ------------------------------------------------------------------ config (eole/config/models.py, trimmed)
class RopeConfig:
    rotary_theta = 10000
    rotary_dim = 0
    rotary_interleave = False
    tmax_index = 0


class TransformerLMDecoderConfig:
    hidden_size = 32
    heads = 4
    heads_kv = 2
    dim_per_head = 8
    transformer_ff = 64
    layers = 2
    norm_eps = 1e-6
    sliding_window = 4
    max_position_embeddings = 128
    rope_config = RopeConfig()


VOCAB = 50
PAD_IDX = 1  # eole's DefaultTokens.PAD "<blank>"


# ------------------------------------------------------------------ eole/modules/rope.py
class RotaryPosition(nn.Module):
    def __init__(self, model_config, ctx_len=0):
        super().__init__()
        self.model_config = model_config
        self.dim_per_head = model_config.dim_per_head
        rope_config = model_config.rope_config
        rotary_dim = rope_config.rotary_dim if rope_config.rotary_dim != 0 else self.dim_per_head
        self.rotary_interleave = rope_config.rotary_interleave
        self.rotary_theta = rope_config.rotary_theta
        inv_freq = 1.0 / (self.rotary_theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_sin", torch.zeros(1), persistent=False)
        self.update(ctx_len if ctx_len > 0 else model_config.max_position_embeddings)

    def forward_1d(self, total_len):
        tmax = torch.arange(total_len, device=self.inv_freq.device, dtype=torch.float32)
        tmax += getattr(self.model_config.rope_config, "tmax_index", 0)
        rope = torch.outer(tmax, self.inv_freq)
        return torch.cos(rope), torch.sin(rope)

    def update(self, seq_len):
        if self.cos_sin.numel() <= 1 or self.cos_sin.size(0) < seq_len:
            cos, sin = self.forward_1d(seq_len)
            new_data = torch.cat([cos, sin], dim=-1)
            del self._buffers["cos_sin"]
            self.register_buffer("cos_sin", new_data, persistent=False)


def apply_rotary_emb(query, key, cos_sin, interleave):
    B, S, H, D = query.shape
    _, _, Hk, _ = key.shape
    Rd = cos_sin.size(1)
    q_rot, q_pass = query[..., :Rd], query[..., Rd:]
    k_rot, k_pass = key[..., :Rd], key[..., Rd:]
    half = Rd // 2
    q1, q2 = q_rot[..., :half], q_rot[..., half:]
    k1, k2 = k_rot[..., :half], k_rot[..., half:]
    cos = cos_sin[None, :, None, : Rd // 2]
    sin = cos_sin[None, :, None, Rd // 2 :]
    qr = q1 * cos - q2 * sin
    qi = q1 * sin + q2 * cos
    kr = k1 * cos - k2 * sin
    ki = k1 * sin + k2 * cos
    q_rotated = torch.cat((qr, qi), dim=-1)
    k_rotated = torch.cat((kr, ki), dim=-1)
    return torch.cat((q_rotated, q_pass), dim=-1), torch.cat((k_rotated, k_pass), dim=-1)


# ------------------------------------------------------------------ eole/modules/multi_headed_attn.py
def bld_to_blhd(x, dim_per_head):
    x_0, x_1, _ = x.size()
    return x.view(x_0, x_1, -1, dim_per_head)


def blhd_to_bld(x):
    x_0, x_1, x_2, x_3 = x.size()
    return x.reshape(x_0, x_1, x_2 * x_3)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden_states * self.weight).to(dtype)


class SelfMHA(nn.Module):
    def __init__(self, model_config):
        super().__init__()
        self.heads = model_config.heads
        self.heads_kv = model_config.heads_kv
        self.dim_per_head = model_config.dim_per_head
        self.parallel_gpu = 1
        self.scale = None
        self.rotary_interleave = model_config.rope_config.rotary_interleave
        kvdim = self.dim_per_head * self.heads_kv
        self.linear_kvq = nn.Linear(model_config.hidden_size, 2 * kvdim + self.dim_per_head * self.heads, bias=False)
        self.final_linear = nn.Linear(self.dim_per_head * self.heads, model_config.hidden_size, bias=False)
        self.kcache, self.vcache, self.cache_leftpad = None, None, None
        self.sliding_window = model_config.sliding_window
        self.window_size = (self.sliding_window, 0) if self.sliding_window > 0 else (-1, -1)

    def _prepare_inputs(self, query, position_embeddings=None):
        kvq = self.linear_kvq(query)
        kvdim = self.dim_per_head * self.heads_kv // self.parallel_gpu
        key = kvq[:, :, :kvdim]
        value = kvq[:, :, kvdim : 2 * kvdim]
        query = kvq[:, :, 2 * kvdim :]
        key = bld_to_blhd(key, self.dim_per_head)
        value = bld_to_blhd(value, self.dim_per_head)
        query = bld_to_blhd(query, self.dim_per_head)
        query, key = apply_rotary_emb(query, key, position_embeddings, interleave=self.rotary_interleave)
        return key, value, query

    def _compute_attention(self, key, value, query, attn_mask=None):
        b, l, h, d = key.size()
        if self.heads_kv < self.heads:
            qh = query.size(2)
            key = key.view(b, l, -1, 1, d).repeat(1, 1, 1, qh // h, 1).view(b, l, qh, d)
            value = value.view(b, l, -1, 1, d).repeat(1, 1, 1, qh // h, 1).view(b, l, qh, d)
        # query.device.type == "cpu": eole's manual attention path
        scale = self.dim_per_head**-0.5 if self.scale is None else self.scale
        scores = torch.matmul(query.transpose(1, 2), key.transpose(1, 2).transpose(2, 3)) * scale
        scores = scores.float()
        if attn_mask is not None:
            if len(attn_mask.size()) == 2:
                attn_mask = attn_mask[None, None, :, :]
            attn_mask = attn_mask[..., : scores.size(3)].expand(-1, self.heads // self.parallel_gpu, -1, -1)
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        attn = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_output = torch.matmul(attn, value.transpose(1, 2)).transpose(1, 2)
        context = blhd_to_bld(attn_output)
        return self.final_linear(context), attn

    def _update_cache_w_inputs(self, query, key, value, cache_seqlens, cache_slice):
        self.kcache[:, cache_slice, :, :] = key
        self.vcache[:, cache_slice, :, :] = value
        return (self.kcache, self.vcache, query)

    def forward(self, query, attn_mask=None, position_embeddings=None, cache_seqlens=None, cache_slice=None):
        key, value, query = self._prepare_inputs(query, position_embeddings=position_embeddings)
        if self.kcache is not None:
            # cache_slice is never None here: no flash_attn on CPU
            key, value, query = self._update_cache_w_inputs(
                query, key, value, cache_seqlens=cache_seqlens, cache_slice=cache_slice
            )
        elif attn_mask is not None:
            attn_mask = attn_mask[..., : key.size(1)]
        return self._compute_attention(key, value, query, attn_mask=attn_mask)


# ------------------------------------------------------------------ eole/modules/transformer_mlp.py
class MLP(nn.Module):
    def __init__(self, model_config):
        super().__init__()
        self.gate_up_proj = nn.Linear(model_config.hidden_size, model_config.transformer_ff, bias=False)
        self.up_proj = nn.Linear(model_config.hidden_size, model_config.transformer_ff, bias=False)
        self.down_proj = nn.Linear(model_config.transformer_ff, model_config.hidden_size, bias=False)
        self.activation = F.silu

    def forward(self, x):
        mlp_out = self.gate_up_proj(x)
        mlp_out = self.activation(mlp_out)
        mlp_out.mul_(self.up_proj(x))
        return self.down_proj(mlp_out)


# ------------------------------------------------------------------ eole/decoders/transformer.py
class TransformerDecoderLayer(nn.Module):
    def __init__(self, decoder_config):
        super().__init__()
        self.layer_type = "full_attention"
        self.input_layernorm = RMSNorm(decoder_config.hidden_size, eps=decoder_config.norm_eps)
        self.self_attn = SelfMHA(decoder_config)
        self.post_attention_layernorm = RMSNorm(decoder_config.hidden_size, eps=decoder_config.norm_eps)
        self.mlp = MLP(decoder_config)
        self.context_attn = None

    def _forward_no_cross_attn(self, layer_in, norm_layer_in, self_attn, attns):
        self_attn.add_(layer_in)
        ff_in = self.post_attention_layernorm(self_attn)
        return self_attn + self.mlp(ff_in), attns

    def forward(self, layer_in, **kwargs):
        attn_mask = kwargs.pop("attn_mask", None)
        position_embeddings = kwargs.pop("position_embeddings", None)
        cache_seqlens = kwargs.pop("cache_seqlens", None)
        cache_slice = kwargs.pop("cache_slice", None)
        norm_layer_in = self.input_layernorm(layer_in)
        self_attn, attns = self.self_attn(
            norm_layer_in,
            attn_mask=attn_mask,
            position_embeddings=position_embeddings,
            cache_seqlens=cache_seqlens,
            cache_slice=cache_slice,
        )
        return self._forward_no_cross_attn(layer_in, norm_layer_in, self_attn, attns)


class TransformerDecoder(nn.Module):
    def __init__(self, decoder_config):
        super().__init__()
        self.sliding_window = decoder_config.sliding_window
        self.kvcache_maxsize = decoder_config.max_position_embeddings
        self.rope = RotaryPosition(decoder_config, ctx_len=self.kvcache_maxsize)
        self.transformer_layers = nn.ModuleList(
            [TransformerDecoderLayer(decoder_config) for _ in range(decoder_config.layers)]
        )
        self.layer_norm = RMSNorm(decoder_config.hidden_size, eps=decoder_config.norm_eps)
        self.LM_type = "causal"
        self.flash = False
        self.dynamic_shapes = True  # not EOLE_TORCH_COMPILE
        self.left_pad_attn_mask = None
        self.position_indices = None
        self.cache_seqlens = None
        self.prefill_chunk_size = 0
        self._disable_cache()

    def _chunk_attn_mask(self, chunk_size, current_step, tgt_pad_mask):
        cache_len = self.cache_len_tgt
        device = tgt_pad_mask.device
        q_pos = (current_step + torch.arange(chunk_size, device=device)).view(-1, 1)
        k_pos = torch.arange(cache_len, device=device).view(1, -1)
        mask = k_pos <= q_pos  # (chunk_size, cache_len)
        if self.sliding_window > 0:
            window_start = q_pos - self.sliding_window + 1
            mask = mask & (k_pos >= window_start)
        mask = mask.unsqueeze(0)
        mask = mask & self.left_pad_attn_mask[:, :cache_len].unsqueeze(1)
        return mask.unsqueeze(1)  # (B, 1, chunk_size, cache_len)

    def _forward_chunked_prefill(self, emb, **kwargs):
        B, S, _ = emb.size()
        chunk_size = self.sliding_window if self.sliding_window > 0 else self.prefill_chunk_size
        tgt_pad_mask_full = kwargs.pop("tgt_pad_mask")
        all_emb_chunks = []
        for start in range(0, S, chunk_size):
            end = min(start + chunk_size, S)
            emb_chunk = emb[:, start:end, :]
            chunk_kwargs = dict(kwargs)
            chunk_kwargs["tgt_pad_mask"] = tgt_pad_mask_full[:, :, start:end]
            emb_chunk_out, _ = self._forward_eager(emb_chunk, **chunk_kwargs)
            all_emb_chunks.append(emb_chunk_out)
        return torch.cat(all_emb_chunks, dim=1), {"std": None}

    def forward(self, emb, **kwargs):
        B, S, _ = emb.size()
        kwargs.pop("src_ids", None)
        effective_chunk = self.sliding_window if self.sliding_window > 0 else self.prefill_chunk_size
        if effective_chunk > 0 and S > effective_chunk and self.cache_seqlens is not None:
            return self._forward_chunked_prefill(emb, **kwargs)
        return self._forward_eager(emb, **kwargs)

    def _forward_eager(self, emb, **kwargs):
        _, S, _ = emb.size()
        tgt_pad_mask = kwargs.pop("tgt_pad_mask", None)
        assert tgt_pad_mask is not None, "TransformerDecoder requires a tgt pad mask"
        assert self.cache_seqlens is not None, "this port only runs the cached (inference) path"
        current_step = self.cache_seqlens[0]

        pos_ids_1d = current_step + torch.arange(S, device=emb.device)
        position_embeddings = self.rope.cos_sin
        pos_emb_list = [position_embeddings[pos_ids_1d]] * len(self.transformer_layers)

        cache_slice = pos_ids_1d
        if S > 1:
            attn_mask = self._chunk_attn_mask(S, current_step, tgt_pad_mask)
        else:
            valid = self.position_indices <= self.cache_seqlens.view(-1, 1)
            valid = valid & self.left_pad_attn_mask
            if self.sliding_window > 0:
                start = torch.clamp(current_step - self.sliding_window + 1, min=0)
                valid = valid & (self.position_indices >= start)
            attn_mask = valid.unsqueeze(1).unsqueeze(2)  # (B, 1, 1, Dynamic Cache Len)

        for layer, pos_emb in zip(self.transformer_layers, pos_emb_list):
            emb, attn = layer(
                emb,
                attn_mask=attn_mask,
                position_embeddings=pos_emb,
                cache_seqlens=self.cache_seqlens,
                cache_slice=cache_slice,
            )

        emb = self.layer_norm(emb)
        self.cache_seqlens.add_(S)
        return emb, {"std": None}

    def _init_cache(self, emb, pad_mask):
        b, l, d = emb.size()
        device = emb.device
        dtype = emb.dtype
        self.flash = False  # device == cpu
        if self.dynamic_shapes:
            self.cache_len_tgt = l
        else:
            self.cache_len_tgt = self.kvcache_maxsize
        mask_int = pad_mask.squeeze(1).to(torch.int8)
        left_pad_counts = mask_int.argmin(dim=-1).to(torch.int32)
        is_left_padded = pad_mask[:, 0, 0]
        cache_leftpad = torch.where(is_left_padded, left_pad_counts, 0)
        self.position_indices = torch.arange(self.cache_len_tgt, device=device).unsqueeze(0)
        self.left_pad_attn_mask = self.position_indices >= cache_leftpad.view(-1, 1)
        self.cache_seqlens = torch.zeros((b,), device=device, dtype=torch.int32)
        for layer in self.transformer_layers:
            heads_kv = layer.self_attn.heads_kv
            dph = layer.self_attn.dim_per_head
            layer.self_attn.kcache = torch.zeros((b, self.cache_len_tgt, heads_kv, dph), dtype=dtype, device=device)
            layer.self_attn.vcache = torch.zeros((b, self.cache_len_tgt, heads_kv, dph), dtype=dtype, device=device)
            layer.self_attn.cache_leftpad = cache_leftpad

    def _extend_cache(self, threshold=1, addzeros=32):
        if self.dynamic_shapes and (self.cache_len_tgt - self.cache_seqlens[0].item()) < threshold:
            for layer in self.transformer_layers:
                b, l, h, d = layer.self_attn.kcache.shape
                extend = torch.zeros(
                    b, addzeros, h, d, device=layer.self_attn.kcache.device, dtype=layer.self_attn.kcache.dtype
                )
                layer.self_attn.kcache = torch.cat([layer.self_attn.kcache, extend], dim=1)
                layer.self_attn.vcache = torch.cat([layer.self_attn.vcache, extend], dim=1)
            self.cache_len_tgt += addzeros
            self.position_indices = torch.arange(self.cache_len_tgt, device=layer.self_attn.kcache.device).unsqueeze(0)
            b, _ = self.left_pad_attn_mask.shape
            extend = torch.ones(b, addzeros, device=self.left_pad_attn_mask.device, dtype=torch.bool)
            self.left_pad_attn_mask = torch.cat([self.left_pad_attn_mask, extend], dim=1)

    def _disable_cache(self):
        self.left_pad_attn_mask = None
        self.cache_seqlens = None
        self.flash = False
        for layer in self.transformer_layers:
            layer.self_attn.kcache, layer.self_attn.vcache = None, None
            layer.self_attn.cache_leftpad = None


class DecoderModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tgt_emb = nn.Embedding(VOCAB, config.hidden_size, padding_idx=PAD_IDX)
        self.decoder = TransformerDecoder(config)
        self.generator = nn.Linear(config.hidden_size, VOCAB, bias=False)


# ------------------------------------------------------------------ eole/predict (GeneratorLM, trimmed to greedy)
class GreedySearch:
    def __init__(self, batch_size, max_length):
        self.max_length = max_length
        self.current_predictions = None
        self.predictions = [[] for _ in range(batch_size)]
        self.log_probs = [[] for _ in range(batch_size)]

    def advance(self, log_probs):
        topk_ids = log_probs.argmax(dim=-1)
        for b in range(log_probs.size(0)):
            self.predictions[b].append(int(topk_ids[b]))
            self.log_probs[b].append(log_probs[b].clone())
        self.current_predictions = topk_ids


class GeneratorLM:
    def __init__(self, model):
        self.model = model
        self._tgt_pad_idx = PAD_IDX

    def _decode_and_generate(self, decoder_in, step):
        emb = self.model.tgt_emb(decoder_in)
        tgt_pad_mask = decoder_in.eq(self._tgt_pad_idx).unsqueeze(1)  # [B, 1, T_tgt]
        if step == 0:
            self.model.decoder._init_cache(emb, tgt_pad_mask)
        dec_out, dec_attn = self.model.decoder(
            emb,
            step=step,
            tgt_pad_mask=tgt_pad_mask,
            src_ids=decoder_in if step == 0 else None,
        )
        if step == 0 and dec_out.dim() == 3 and dec_out.size(1) > 1:
            dec_out = dec_out[:, -1:, :]
        scores = self.model.generator(dec_out.squeeze(1))
        return log_softmax(scores, dim=-1), None

    @torch.no_grad()
    def predict_batch(self, batch, max_length):
        src = batch["src"]
        src_len = batch["srclen"]
        assert batch["left_pad"]
        decode_strategy = GreedySearch(len(src_len), max_length)
        prefill_length = max(src_len.tolist())
        for step in range(decode_strategy.max_length):
            decoder_input = src if step == 0 else decode_strategy.current_predictions.view(-1, 1)
            log_probs, attn = self._decode_and_generate(
                decoder_input, step=step if step == 0 else step + prefill_length - 1
            )
            decode_strategy.advance(log_probs)
            self.model.decoder._extend_cache()  # noop when dynamic_shape is False
        self.model.decoder._disable_cache()
        return decode_strategy


def left_pad_batch(prompts):
    """Inference batches are left padded with the pad id (batch["left_pad"] = True)."""
    srclen = torch.tensor([len(p) for p in prompts])
    T = int(srclen.max())
    src = torch.full((len(prompts), T), PAD_IDX, dtype=torch.long)
    for i, p in enumerate(prompts):
        src[i, T - len(p) :] = torch.tensor(p)
    return {"src": src, "srclen": srclen, "left_pad": True}


# ------------------------------------------------------------------ reference: one prompt, no padding, no cache
@torch.no_grad()
def reference_log_probs(model, ids, window):
    cfg = TransformerLMDecoderConfig
    T = len(ids)
    x = model.tgt_emb(torch.tensor(ids)[None])  # (1, T, d)
    pos = torch.arange(T, dtype=torch.float32)
    inv_freq = 1.0 / (cfg.rope_config.rotary_theta ** (torch.arange(0, cfg.dim_per_head, 2).float() / cfg.dim_per_head))
    ang = torch.outer(pos, inv_freq)
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]

    def rope(t):  # t: (T, H, D), rotate halves
        half = t.size(-1) // 2
        t1, t2 = t[..., :half], t[..., half:]
        return torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)

    kvdim = cfg.dim_per_head * cfg.heads_kv
    group = cfg.heads // cfg.heads_kv
    for layer in model.decoder.transformer_layers:
        attn_mod = layer.self_attn
        h = layer.input_layernorm(x)[0]
        kvq = h @ attn_mod.linear_kvq.weight.T
        k = rope(kvq[:, :kvdim].view(T, cfg.heads_kv, cfg.dim_per_head))
        v = kvq[:, kvdim : 2 * kvdim].view(T, cfg.heads_kv, cfg.dim_per_head)
        q = rope(kvq[:, 2 * kvdim :].view(T, cfg.heads, cfg.dim_per_head))
        out = torch.zeros(T, cfg.heads, cfg.dim_per_head)
        for i in range(T):
            lo = max(0, i - window + 1)
            for hd in range(cfg.heads):
                kh = k[lo : i + 1, hd // group]
                vh = v[lo : i + 1, hd // group]
                w = torch.softmax((kh @ q[i, hd]) * cfg.dim_per_head**-0.5, dim=-1)
                out[i, hd] = w @ vh
        a = out.reshape(1, T, -1) @ attn_mod.final_linear.weight.T
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.decoder.layer_norm(x)
    return log_softmax(model.generator(x[0, -1]), dim=-1)


def reference_greedy(model, prompt, max_length, window):
    ids = list(prompt)
    toks, lps = [], []
    for _ in range(max_length):
        lp = reference_log_probs(model, ids, window)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(lp)
        ids.append(t)
    return toks, lps


def main():
    config = TransformerLMDecoderConfig()
    model = DecoderModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
        model.tgt_emb.weight[PAD_IDX].zero_()  # padding_idx row

    g = torch.Generator().manual_seed(1)
    lengths = [11, 6, 9, 3]  # 11 > sliding_window: chunked prefill of 4 + 4 + 3
    prompts = [(torch.randint(2, VOCAB, (n,), generator=g)).tolist() for n in lengths]
    batch = left_pad_batch(prompts)
    max_length = 9

    predictor = GeneratorLM(model)
    result = predictor.predict_batch(batch, max_length)

    for b, prompt in enumerate(prompts):
        ref_toks, ref_lps = reference_greedy(model, prompt, max_length, config.sliding_window)
        assert result.predictions[b] == ref_toks, (b, result.predictions[b], ref_toks)
        assert PAD_IDX not in ref_toks  # a generated <blank> would read as padding to a later pad mask
        for step, (got, want) in enumerate(zip(result.log_probs[b], ref_lps)):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=f"prompt {b} step {step}")
        print(f"prompt {b} (len {len(prompt)}, {batch['src'].size(1) - len(prompt)} pads): {result.predictions[b]}")
    print("left-padded chunked-prefill + cached sliding-window greedy decode matches per-prompt reference")


if __name__ == "__main__":
    main()
