# Citation: flashrt-project/FlashRT#75 ("Fix Pi0.5 decoder RoPE positions"), commit b8b44d30
#   (parent read: b8b44d30^).
# Upstream: flash_rt/models/pi05/pipeline_rtx.py (and pipeline_rtx_fp16.py) -- Pi05Pipeline:
#   _build_rope_table, _set_decoder_rope_for_prompt, set_language_embeds, transformer_encoder /
#   _encoder_layer (prefix of pooled vision tokens + prompt written into the shared K/V cache at
#   [0, encoder_seq_len)), transformer_decoder / _decoder_layer (the action chunk's K/V appended at
#   offset enc_seq, its queries attending over kv_seq = enc_seq + chunk_size).
# Bug: the action expert's rows of the RoPE table are sliced from vision_seq_enc + prompt_len - 1,
#   so the first action token is rotated at the last prompt token's position and the whole chunk
#   sits one place early (openpi numbers the suffix prefix_offsets + cumsum(suffix_mask) - 1, i.e.
#   from vision_seq_enc + prompt_len).
# Fix: start = vision_seq_enc + prompt_len (and the placeholder slice from vision_seq_enc).
#
# The CUDA pipeline (cuBLASLt GEMMs, fused qkv_split_rope kernel, flash-attn backend) is written
# here in plain torch on CPU, float32, with its buffer names; sizes are shrunk (2 views of 4
# vision tokens, 2 encoder / 2 decoder layers, head_dim 16, GQA 2:1). The SigLIP tower and the
# AdaRMS style tables are reduced to a projector and a per-step time embedding.
import sys

import numpy as np
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VIS_SEQ_PER_VIEW = 4
VIS_D = 24

ENC_L = 2
ENC_D = 32
ENC_H = 64
ENC_NH = 2           # query heads (GQA)
ENC_NKV = 1          # kv heads (GQA)
ENC_HD = 16

DEC_L = 2
DEC_D = 24
DEC_H = 48
DEC_NH = 2
DEC_NKV = 1
DEC_HD = 16

ACTION_DIM = 6
NUM_STEPS_DEFAULT = 4


def qkv_split_rope(qkv, rope_weights, nh, nkv, hd):
    """fvk.qkv_split_rope: split (seq, (nh+2*nkv)*hd) and rotate Q, K pairwise with the
    interleaved [cos0, sin0, cos1, sin1, ...] table rows (one row per token)."""
    seq = qkv.shape[0]
    q = qkv[:, : nh * hd].reshape(seq, nh, hd)
    k = qkv[:, nh * hd: (nh + nkv) * hd].reshape(seq, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].reshape(seq, nkv, hd)
    c = rope_weights[:, 0::2][:, None, :]
    s = rope_weights[:, 1::2][:, None, :]

    def rot(x):
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).reshape(x.shape)

    return rot(q), rot(k), v


def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RtxFlashAttnBackend:
    """Shared K/V cache (num_layers, total_kv_max, NKV, HD) read by the encoder and decoder sites."""

    def __init__(self, total_kv_max):
        self.enc_K = torch.zeros(max(ENC_L, DEC_L), total_kv_max, ENC_NKV, ENC_HD)
        self.enc_V = torch.zeros_like(self.enc_K)

    def _attn(self, q, k, v):
        q = q.transpose(0, 1)[None]
        k = k.transpose(0, 1)[None].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.transpose(0, 1)[None].repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        o = F.scaled_dot_product_attention(q, k, v)
        return o[0].transpose(0, 1).reshape(q.shape[2], -1)

    def run(self, site, layer_idx, q_seq, *, kv_seq=None, Q=None):
        if site == "encoder":
            return self._attn(Q, self.enc_K[layer_idx, :q_seq], self.enc_V[layer_idx, :q_seq])
        if site == "decoder":
            return self._attn(Q, self.enc_K[layer_idx, :kv_seq], self.enc_V[layer_idx, :kv_seq])
        raise KeyError(site)


class Pi05Pipeline:
    def __init__(self, attn_backend, weights, *, num_views, max_prompt_len,
                 chunk_size=NUM_STEPS_DEFAULT, num_steps=NUM_STEPS_DEFAULT, vision_pool_factor=1):
        self.attn = attn_backend
        self.weights = weights
        self.num_views = int(num_views)
        self.max_prompt_len = int(max_prompt_len)
        self.chunk_size = int(chunk_size)
        self.num_steps = int(num_steps)
        pf = int(vision_pool_factor)
        self.vision_seq = self.num_views * VIS_SEQ_PER_VIEW
        self.vision_seq_enc = self.vision_seq // (pf * pf)
        self.encoder_seq_len = self.vision_seq_enc + self.max_prompt_len
        self.total_kv = self.encoder_seq_len + self.chunk_size
        self.bufs = {
            "encoder_x": torch.zeros(self.encoder_seq_len, ENC_D),
            "vision_x_pooled": torch.zeros(self.vision_seq_enc, VIS_D),
            "diffusion_noise": torch.zeros(self.chunk_size, ACTION_DIM),
        }
        self._build_rope_table()

    # RoPE table
    def _build_rope_table(self):
        max_pos = self.encoder_seq_len + self.chunk_size
        inv_freq = 1.0 / (10000 ** (np.arange(0, ENC_HD, 2, dtype=np.float64) / ENC_HD))
        positions = np.arange(max_pos, dtype=np.float64)
        phase = positions[:, None] * inv_freq[None, :]
        cos = np.cos(phase).astype(np.float32)
        sin = np.sin(phase).astype(np.float32)
        interleaved = np.stack([cos, sin], axis=-1).reshape(max_pos, ENC_HD)
        self._rope_table_np = interleaved

        enc_rope_slice = interleaved[:self.encoder_seq_len]
        self.bufs["encoder_rope_weights"] = torch.from_numpy(np.ascontiguousarray(enc_rope_slice))

        # Decoder RoPE: placeholder, will be overwritten per-prompt.
        if FIXED:
            dec_rope_slice = interleaved[self.vision_seq_enc: self.vision_seq_enc + self.chunk_size]
        else:
            dec_rope_slice = interleaved[
                self.vision_seq_enc - 1: self.vision_seq_enc - 1 + self.chunk_size]
        self.bufs["decoder_rope_weights"] = torch.from_numpy(np.ascontiguousarray(dec_rope_slice))

    def _set_decoder_rope_for_prompt(self, prompt_len):
        """Update ``decoder_rope_weights`` for a new prompt length."""
        if FIXED:
            start = self.vision_seq_enc + prompt_len
        else:
            start = self.vision_seq_enc + prompt_len - 1
        end = start + self.chunk_size
        self.bufs["decoder_rope_weights"] = torch.from_numpy(
            np.ascontiguousarray(self._rope_table_np[start:end]))

    def set_language_embeds(self, lang_embeds):
        prompt_len = lang_embeds.shape[0]
        assert prompt_len <= self.max_prompt_len
        self._lang_embeds_buf = lang_embeds.clone()
        self._current_prompt_len = prompt_len
        self._set_decoder_rope_for_prompt(prompt_len)
        self._copy_lang_embeds_to_encoder_x()

    def _copy_lang_embeds_to_encoder_x(self):
        vs = self.vision_seq_enc
        self.bufs["encoder_x"][vs: vs + self._lang_embeds_buf.shape[0]] = self._lang_embeds_buf

    # Encoder (Gemma-2B prefix): writes the K/V cache [0, encoder_seq_len)
    def transformer_encoder(self):
        W = self.weights
        B = self.bufs
        seq = self.encoder_seq_len
        vs_enc = self.vision_seq_enc
        B["encoder_x"][:vs_enc] = (F.layer_norm(B["vision_x_pooled"], (VIS_D,))
                                   @ W["encoder_multi_modal_projector_w"]
                                   + W["encoder_multi_modal_projector_b"])
        for i in range(ENC_L):
            self._encoder_layer(i, seq)

    def _encoder_layer(self, i, seq):
        W = self.weights
        B = self.bufs
        x_norm = rms_norm(B["encoder_x"])
        qkv = x_norm @ W["encoder_attn_qkv_w"][i]
        q, k, v = qkv_split_rope(qkv, B["encoder_rope_weights"], ENC_NH, ENC_NKV, ENC_HD)
        self.attn.enc_K[i, :seq] = k
        self.attn.enc_V[i, :seq] = v
        if i == ENC_L - 1:
            # Last layer: the encoder output is the K/V cache the decoder reads.
            return
        o = self.attn.run("encoder", i, q_seq=seq, Q=q)
        B["encoder_x"] = B["encoder_x"] + o @ W["encoder_attn_o_w"][i]
        h = rms_norm(B["encoder_x"])
        gate, up = (h @ W["encoder_ffn_gate_up_w"][i]).chunk(2, dim=-1)
        B["encoder_x"] = B["encoder_x"] + (F.gelu(gate, approximate="tanh") * up) @ W["encoder_ffn_down_w"][i]

    # Decoder (Gemma-300M action expert): 10-step flow-matching denoise
    def transformer_decoder(self):
        W = self.weights
        B = self.bufs
        enc_seq = self.encoder_seq_len
        ds = self.chunk_size
        for step in range(self.num_steps):
            B["decoder_x"] = B["diffusion_noise"] @ W["decoder_action_in_proj_w"] + W["decoder_action_in_proj_b"]
            for i in range(DEC_L):
                self._decoder_layer(i, step, enc_seq, ds)
            x_normed = rms_norm(B["decoder_x"]) * (1 + W["decoder_style_final"][step])
            action = x_normed @ W["decoder_action_out_proj_w"] + W["decoder_action_out_proj_b"]
            # noise += action_buf (weights pre-scaled by -1/num_steps by frontend)
            B["diffusion_noise"] = B["diffusion_noise"] + action

    def _decoder_layer(self, i, step, enc_seq, ds):
        W = self.weights
        B = self.bufs
        x_normed = rms_norm(B["decoder_x"]) * (1 + W["decoder_style_attn"][step, i])
        qkv = x_normed @ W["decoder_attn_qkv_w"][i]
        # Decoder K/V write into enc cache at offset enc_seq.
        q, k, v = qkv_split_rope(qkv, B["decoder_rope_weights"], DEC_NH, DEC_NKV, DEC_HD)
        self.attn.enc_K[i, enc_seq: enc_seq + ds] = k
        self.attn.enc_V[i, enc_seq: enc_seq + ds] = v
        o = self.attn.run("decoder", i, q_seq=ds, kv_seq=enc_seq + ds, Q=q)
        B["decoder_x"] = B["decoder_x"] + o @ W["decoder_attn_o_w"][i]
        h = rms_norm(B["decoder_x"]) * (1 + W["decoder_style_ffn"][step, i])
        gate, up = (h @ W["decoder_ffn_gate_up_w"][i]).chunk(2, dim=-1)
        B["decoder_x"] = B["decoder_x"] + (F.gelu(gate, approximate="tanh") * up) @ W["decoder_ffn_down_w"][i]

    def run_pipeline(self):
        self._copy_lang_embeds_to_encoder_x()
        self.transformer_encoder()
        self.transformer_decoder()

    def forward(self):
        self.run_pipeline()
        return self.bufs["diffusion_noise"]


def make_weights(num_steps):
    def r(*shape, scale=0.3):
        return torch.randn(*shape) * scale

    qkv_enc = (ENC_NH + 2 * ENC_NKV) * ENC_HD
    qkv_dec = (DEC_NH + 2 * DEC_NKV) * DEC_HD
    return {
        "encoder_multi_modal_projector_w": r(VIS_D, ENC_D),
        "encoder_multi_modal_projector_b": r(ENC_D),
        "encoder_attn_qkv_w": [r(ENC_D, qkv_enc) for _ in range(ENC_L)],
        "encoder_attn_o_w": [r(ENC_NH * ENC_HD, ENC_D) for _ in range(ENC_L)],
        "encoder_ffn_gate_up_w": [r(ENC_D, 2 * ENC_H) for _ in range(ENC_L)],
        "encoder_ffn_down_w": [r(ENC_H, ENC_D, scale=0.1) for _ in range(ENC_L)],
        "decoder_action_in_proj_w": r(ACTION_DIM, DEC_D),
        "decoder_action_in_proj_b": r(DEC_D),
        "decoder_attn_qkv_w": [r(DEC_D, qkv_dec) for _ in range(DEC_L)],
        "decoder_attn_o_w": [r(DEC_NH * DEC_HD, DEC_D) for _ in range(DEC_L)],
        "decoder_ffn_gate_up_w": [r(DEC_D, 2 * DEC_H) for _ in range(DEC_L)],
        "decoder_ffn_down_w": [r(DEC_H, DEC_D, scale=0.1) for _ in range(DEC_L)],
        "decoder_style_attn": r(num_steps, DEC_L, DEC_D, scale=0.1),
        "decoder_style_ffn": r(num_steps, DEC_L, DEC_D, scale=0.1),
        "decoder_style_final": r(num_steps, DEC_D, scale=0.1),
        "decoder_action_out_proj_w": r(DEC_D, ACTION_DIM, scale=-1.0 / num_steps),
        "decoder_action_out_proj_b": r(ACTION_DIM, scale=0.01),
    }


def main():
    num_views, chunk_size, num_steps = 2, 4, NUM_STEPS_DEFAULT
    weights = make_weights(num_steps)
    # The frontend rebuilds the pipeline with the exact prompt length (no pad slots).
    prompt_embeds = torch.randn(5, ENC_D)
    prompt_len = prompt_embeds.shape[0]
    backend = RtxFlashAttnBackend(num_views * VIS_SEQ_PER_VIEW + prompt_len + chunk_size)
    pipeline = Pi05Pipeline(backend, weights, num_views=num_views, max_prompt_len=prompt_len,
                            chunk_size=chunk_size, num_steps=num_steps)
    pipeline.set_language_embeds(prompt_embeds)
    pipeline.bufs["vision_x_pooled"] = torch.randn(pipeline.vision_seq_enc, VIS_D)
    pipeline.bufs["diffusion_noise"] = torch.randn(chunk_size, ACTION_DIM)
    actions = pipeline.forward()
    torch.set_printoptions(precision=4, sci_mode=False)
    print("fixed" if FIXED else "buggy", "prompt_len", prompt_len, "encoder_seq_len", pipeline.encoder_seq_len)
    print("actions:\n", actions)


if __name__ == "__main__":
    main()
