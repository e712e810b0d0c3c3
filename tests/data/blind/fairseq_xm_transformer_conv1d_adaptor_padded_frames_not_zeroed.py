"""fairseq xm_transformer (wav2vec 2.0 encoder + Conv1dAdaptor + mBART-style decoder), speech-to-text.

Citation: facebookresearch/fairseq#4613 (commit 4fe8583, "padding fix in the adaptor layer"),
fairseq/models/speech_to_text/xm_transformer.py, Conv1dAdaptor.forward and
Wav2VecEncoderWithAdaptor.forward.

Bug: the wav2vec encoder hands the adaptor a T x B x C batch whose padded frames hold whatever the
transformer layers wrote there (not zeros). Conv1dAdaptor runs its strided Conv1d + GLU stack over
the whole padded batch and only afterwards rebuilds the padding mask from the downsampled lengths,
so the last real output frames of a short utterance read its padded frames through the kernel; the
decoder's cross-attention then attends those frames as real encoder output. Results depend on the
batch's max length.
Fix: zero the padded frames (index_put with padding_mask.T) before the convolutions, and zero the
output frames past out_padding_mask afterwards.

Trimmed: the wav2vec 2.0 model is a small stand-in (linear frame projection + seq-first
nn.TransformerEncoderLayer with a key padding mask, as fairseq's TransformerEncoder runs T x B x C);
the decoder is one pre-LN layer of causal self-attention and cross-attention over encoder_out with
encoder_padding_mask, as fairseq's TransformerDecoder uses it. Weights random, seeded.
"""
import sys
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


# fairseq/data/data_utils.py
def lengths_to_padding_mask(lens):
    bsz, max_lens = lens.size(0), torch.max(lens).item()
    mask = torch.arange(max_lens).to(lens.device).view(1, max_lens)
    mask = mask.expand(bsz, -1) >= lens.view(bsz, 1).expand(-1, max_lens)
    return mask


# fairseq/utils.py (non-XLA branch)
def index_put(tensor, indices, value):
    tensor[indices] = value
    return tensor


class Conv1dAdaptor(nn.Module):
    def __init__(
        self,
        in_dim,
        out_dim,
        n_layers=3,
        kernel_size=3,
        stride=2,
        layerdrop=0.0,
        layernorm=False,
        proj=False,
    ):
        super().__init__()
        self.proj, self.proj_ln = None, None
        self.post_proj, self.post_proj_ln = None, None
        if proj:
            self.proj = nn.Sequential(
                nn.Linear(in_dim, in_dim * 4), nn.ReLU(), nn.Linear(in_dim * 4, in_dim)
            )
            self.proj_ln = nn.LayerNorm(in_dim)
            self.post_proj = nn.Sequential(
                nn.Linear(out_dim, out_dim * 4),
                nn.ReLU(),
                nn.Linear(out_dim * 4, out_dim),
            )
            self.post_proj_ln = nn.LayerNorm(out_dim)

        self.layers = nn.ModuleList(
            nn.Conv1d(
                in_dim if i == 0 else out_dim,
                out_dim * 2,
                kernel_size,
                stride=stride,
                padding=kernel_size // 2,
            )
            for i in range(n_layers)
        )
        self.stride = stride
        self.layerdrop = layerdrop
        self.layernorm = nn.LayerNorm(in_dim) if layernorm else None

    def forward(self, x, padding_mask: Optional[torch.Tensor]):
        if self.layernorm is not None:
            x = self.layernorm(x)

        if self.proj is not None:
            x = x + 0.5 * self.proj(x)
            x = self.proj_ln(x)

        if FIXED and padding_mask is not None:
            x = index_put(x, padding_mask.T, 0)

        # T x B x C -> B x C x T
        x = x.transpose(0, 1).transpose(1, 2)
        out_lens = None
        if padding_mask is not None:
            out_lens = (~padding_mask).sum(1).float()

        for layer in self.layers:
            layerdrop_prob = np.random.random()
            if not self.training or (layerdrop_prob > self.layerdrop):
                x = nn.functional.glu(layer(x), dim=1)
                if padding_mask is not None:
                    out_lens = ((out_lens - 1) / self.stride + 1).floor()
        # B x C x T -> T x B x C
        x = x.transpose(1, 2).transpose(0, 1)

        if self.post_proj is not None:
            x = x + 0.5 * self.post_proj(x)
            x = self.post_proj_ln(x)

        out_padding_mask = None
        if padding_mask is not None:
            out_padding_mask = lengths_to_padding_mask(out_lens.long())
            if FIXED:
                x = index_put(x, out_padding_mask.T, 0)
        return x, out_padding_mask


class Wav2VecEncoderStandIn(nn.Module):
    """Returns {"encoder_out": T x B x C, "padding_mask": B x T} like fairseq's Wav2VecEncoder(tbc=True)."""

    def __init__(self, feat_dim, dim, heads, layers):
        super().__init__()
        self.feature_proj = nn.Linear(feat_dim, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=0.0) for _ in range(layers)
        )
        self.layer_norm = nn.LayerNorm(dim)

    def forward(self, source, padding_mask, tbc=True):
        x = self.feature_proj(source).transpose(0, 1)  # B x T x C -> T x B x C
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding_mask)
        x = self.layer_norm(x)
        return {"encoder_out": x, "padding_mask": padding_mask}


class Wav2VecEncoderWithAdaptor(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w2v_encoder = Wav2VecEncoderStandIn(
            args.feat_dim, args.w2v_dim, args.heads, args.w2v_layers
        )
        self.w2v_proj_ln = nn.LayerNorm(args.w2v_dim) if args.w2v_proj_ln else None
        self.adaptor = Conv1dAdaptor(
            args.w2v_dim,
            args.decoder_embed_dim,
            n_layers=args.adaptor_n_layers,
            kernel_size=args.adaptor_kernel_size,
            stride=args.adaptor_stride,
            layerdrop=args.adaptor_layerdrop,
            layernorm=args.adaptor_layernorm,
            proj=args.adaptor_proj,
        )

    def forward(self, src_tokens, src_lengths=None, **kwargs):
        padding_mask = lengths_to_padding_mask(src_lengths)
        out = self.w2v_encoder.forward(src_tokens, padding_mask, tbc=True)
        x, padding_mask = out["encoder_out"], out["padding_mask"]
        if self.w2v_proj_ln is not None:
            x = self.w2v_proj_ln(x)

        if self.adaptor is not None:
            x, padding_mask = self.adaptor(x, padding_mask)

        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [] if padding_mask is None else [padding_mask],  # B x T
        }


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads)
        self.encoder_attn = nn.MultiheadAttention(dim, heads)
        self.fc = nn.Sequential(nn.Linear(dim, dim * 2), nn.ReLU(), nn.Linear(dim * 2, dim))
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, encoder_out, encoder_padding_mask, self_attn_mask):
        h = self.ln1(x)
        x = x + self.self_attn(h, h, h, attn_mask=self_attn_mask, need_weights=False)[0]
        h = self.ln2(x)
        x = x + self.encoder_attn(
            h, encoder_out, encoder_out, key_padding_mask=encoder_padding_mask, need_weights=False
        )[0]
        return x + self.fc(self.ln3(x))


class Decoder(nn.Module):
    def __init__(self, vocab, dim, heads, max_pos=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim, padding_idx=1)
        self.embed_positions = nn.Embedding(max_pos, dim)
        self.layer = DecoderLayer(dim, heads)
        self.layer_norm = nn.LayerNorm(dim)
        self.output_projection = nn.Linear(dim, vocab, bias=False)

    def forward(self, prev_output_tokens, encoder_out):
        bsz, tgt_len = prev_output_tokens.shape
        pos = torch.arange(tgt_len).unsqueeze(0)
        x = (self.embed_tokens(prev_output_tokens) + self.embed_positions(pos)).transpose(0, 1)
        causal = torch.triu(torch.full((tgt_len, tgt_len), float("-inf")), 1)
        enc = encoder_out["encoder_out"][0]
        enc_pad = encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None
        x = self.layer(x, enc, enc_pad, causal)
        x = self.layer_norm(x).transpose(0, 1)
        return self.output_projection(x)


class Args:
    feat_dim = 16
    w2v_dim = 32
    heads = 4
    w2v_layers = 2
    w2v_proj_ln = True
    decoder_embed_dim = 32
    adaptor_n_layers = 3
    adaptor_kernel_size = 3
    adaptor_stride = 2
    adaptor_layerdrop = 0.0
    adaptor_layernorm = False
    adaptor_proj = False
    vocab = 20


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    args = Args()
    encoder = Wav2VecEncoderWithAdaptor(args).eval()
    decoder = Decoder(args.vocab, args.decoder_embed_dim, args.heads).eval()

    # two utterances (already framed features), right padded to the longer one
    src_lengths = torch.tensor([9, 40])
    src_tokens = torch.zeros(2, 40, args.feat_dim)
    for b, n in enumerate(src_lengths.tolist()):
        src_tokens[b, :n] = torch.randn(n, args.feat_dim)

    # teacher-forced targets, right padded with pad=1 (eos=2, bos=0)
    target = torch.tensor([[5, 7, 9, 2, 1], [4, 6, 8, 10, 2]])
    prev_output_tokens = torch.tensor([[2, 5, 7, 9, 1], [2, 4, 6, 8, 10]])

    with torch.no_grad():
        encoder_out = encoder(src_tokens, src_lengths)
        logits = decoder(prev_output_tokens, encoder_out)
        lprobs = torch.log_softmax(logits, dim=-1)
        loss = nn.functional.nll_loss(
            lprobs.reshape(-1, args.vocab), target.reshape(-1), ignore_index=1, reduction="sum"
        )
        hyp = lprobs.argmax(-1)

    print("encoder out lengths:", (~encoder_out["encoder_padding_mask"][0]).sum(1).tolist())
    n0 = int((~encoder_out["encoder_padding_mask"][0][0]).sum())
    print("utterance 0 encoder_out, last real frame (first 4 dims):",
          [round(v, 5) for v in encoder_out["encoder_out"][0][n0 - 1, 0, :4].tolist()])
    print("nll loss (sum): %.6f" % loss.item())
    print("utterance 0 log-probs of its targets:",
          [round(v, 5) for v in lprobs[0, :4].gather(-1, target[0, :4, None]).squeeze(-1).tolist()])
    print("argmax tokens:", hyp.tolist())


if __name__ == "__main__":
    main()
