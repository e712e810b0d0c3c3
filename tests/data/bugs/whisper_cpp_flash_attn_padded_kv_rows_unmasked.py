"""whisper.cpp (torch port): flash-attention encoder and cross-attention read K/V padded to 256 rows, no mask.

Citation: ggml-org/whisper.cpp#3941 ("whisper : mask padded K/V in flash-attention encoder and
cross-attention"; an open pull request, read from its description - the diff was not available).

Bug: with flash attention on, whisper_build_graph_encoder stores K/V in the kv_pad buffer and the
decoder's cross-attention reads kv_cross, both viewed with GGML_PAD(n_ctx, 256) rows, but only
n_ctx rows are written, and ggml_flash_attn_ext is called with a null mask. The unwritten pad
rows (zeros on a fresh state, leftovers of earlier calls otherwise) are attended at full weight;
a reduced audio_ctx (here 40 frames) makes 216 of the 256 key rows padding.
Fix: give both call sites a KQ mask input, like the decoder self-attention's KQ_mask, that is
-INFINITY over [n_ctx, n_ctx_pad), filled in whisper_encode_internal / whisper_decode_internal.

Reproduction: a one-layer encoder and a one-token decoder step written against a persistent
whisper_state whose buffers are n_ctx_pad rows long, attention through
F.scaled_dot_product_attention standing in for ggml_flash_attn_ext (mask None when buggy).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def GGML_PAD(x, n):
    return (x + n - 1) // n * n


@dataclass
class whisper_hparams:
    n_audio_ctx: int = 1500
    n_audio_state: int = 32
    n_audio_head: int = 4
    n_text_state: int = 32
    n_text_head: int = 4
    n_vocab: int = 50


class whisper_layer(nn.Module):
    def __init__(self, n_state):
        super().__init__()
        self.attn_q = nn.Linear(n_state, n_state)
        self.attn_k = nn.Linear(n_state, n_state, bias=False)
        self.attn_v = nn.Linear(n_state, n_state)
        self.attn_ln_1 = nn.Linear(n_state, n_state)


class whisper_state:
    """Buffers that outlive one whisper_full call: kv_pad (encoder) and kv_cross (decoder)."""

    def __init__(self, hparams):
        n_ctx_pad = GGML_PAD(hparams.n_audio_ctx, 256)
        self.kv_pad_k = torch.zeros(n_ctx_pad, hparams.n_audio_state)
        self.kv_pad_v = torch.zeros(n_ctx_pad, hparams.n_audio_state)
        self.kv_cross_k = torch.zeros(n_ctx_pad, hparams.n_text_state)
        self.kv_cross_v = torch.zeros(n_ctx_pad, hparams.n_text_state)
        self.exp_n_audio_ctx = 0


def flash_attn_ext(Q, K, V, mask, scale):
    """ggml_flash_attn_ext: Q (n_head, n_q, d), K/V (n_head, n_kv, d), additive mask (n_q, n_kv) or None."""
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale)


class whisper_model(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.hparams = hparams
        self.e_layer = whisper_layer(hparams.n_audio_state)
        self.cross_attn_k = nn.Linear(hparams.n_audio_state, hparams.n_text_state, bias=False)
        self.cross_attn_v = nn.Linear(hparams.n_audio_state, hparams.n_text_state)
        self.cross_attn_q = nn.Linear(hparams.n_text_state, hparams.n_text_state)
        self.d_te = nn.Embedding(hparams.n_vocab, hparams.n_text_state)
        self.d_out = nn.Linear(hparams.n_text_state, hparams.n_vocab, bias=False)


def whisper_encode_internal(model, wstate, mel_embd, n_ctx):
    """mel_embd: (n_ctx, n_state) conv output for the audio_ctx frames actually used."""
    hp = model.hparams
    n_state, n_head = hp.n_audio_state, hp.n_audio_head
    d = n_state // n_head
    n_ctx_pad = GGML_PAD(n_ctx, 256)
    layer = model.e_layer

    Qcur = layer.attn_q(mel_embd)
    # store key and value into the padded buffer: only the first n_ctx rows are written
    wstate.kv_pad_k[:n_ctx] = layer.attn_k(mel_embd).detach()
    wstate.kv_pad_v[:n_ctx] = layer.attn_v(mel_embd).detach()
    K = wstate.kv_pad_k[:n_ctx_pad]
    V = wstate.kv_pad_v[:n_ctx_pad]

    KQ_mask = None
    if FIXED:
        KQ_mask = torch.zeros(n_ctx, n_ctx_pad)
        KQ_mask[:, n_ctx:] = -float("inf")

    Q = Qcur.view(n_ctx, n_head, d).transpose(0, 1)
    K = K.view(n_ctx_pad, n_head, d).transpose(0, 1)
    V = V.view(n_ctx_pad, n_head, d).transpose(0, 1)
    cur = flash_attn_ext(Q, K, V, KQ_mask, 1.0 / d ** 0.5)
    cur = cur.transpose(0, 1).reshape(n_ctx, n_state)
    cur = mel_embd + layer.attn_ln_1(cur)

    # cross-attention K/V of the decoder, computed once per encode
    wstate.kv_cross_k[:n_ctx] = model.cross_attn_k(cur).detach()
    wstate.kv_cross_v[:n_ctx] = model.cross_attn_v(cur).detach()
    wstate.exp_n_audio_ctx = n_ctx
    return cur


def whisper_decode_internal(model, wstate, tokens):
    hp = model.hparams
    n_state, n_head = hp.n_text_state, hp.n_text_head
    d = n_state // n_head
    n_tokens = tokens.shape[0]
    n_audio_ctx = wstate.exp_n_audio_ctx
    n_audio_ctx_pad = GGML_PAD(n_audio_ctx, 256)

    cur = model.d_te(tokens)
    Q = model.cross_attn_q(cur).view(n_tokens, n_head, d).transpose(0, 1)
    Kcross = wstate.kv_cross_k[:n_audio_ctx_pad].view(n_audio_ctx_pad, n_head, d).transpose(0, 1)
    Vcross = wstate.kv_cross_v[:n_audio_ctx_pad].view(n_audio_ctx_pad, n_head, d).transpose(0, 1)

    KQ_mask_cross = None
    if FIXED:
        KQ_mask_cross = torch.zeros(n_tokens, n_audio_ctx_pad)
        KQ_mask_cross[:, n_audio_ctx:] = -float("inf")

    cur = cur + flash_attn_ext(Q, Kcross, Vcross, KQ_mask_cross, 1.0 / d ** 0.5).transpose(0, 1).reshape(
        n_tokens, n_state)
    return model.d_out(cur)


if __name__ == "__main__":
    torch.manual_seed(0)
    hparams = whisper_hparams()
    model = whisper_model(hparams).eval()
    wstate = whisper_state(hparams)
    audio_ctx = 40  # whisper_full_params.audio_ctx: a 0.8 s clip
    mel_embd = torch.randn(audio_ctx, hparams.n_audio_state)
    with torch.no_grad():
        enc = whisper_encode_internal(model, wstate, mel_embd, audio_ctx)
        logits = whisper_decode_internal(model, wstate, torch.tensor([1, 7, 9]))
    print("enc[0,:3]", [round(v, 4) for v in enc[0, :3].tolist()], "next", logits[-1].argmax().item())
