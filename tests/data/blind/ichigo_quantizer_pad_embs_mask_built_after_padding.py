# janhq/WhisperSpeech#19 (commit ced5f84, "fix: missing PAD token"), ichigo-quantizer/data/dataset.py
# WhisperDataset.__getitem__ / concatenated samples, and models/vq_transformer.py _process_quantization.
#
# The dataset builds the frame mask that RQBottleneckTransformer uses (mask_embs) to put the PAD code's
# embedding on the padded encoder frames before the out blocks and the Whisper decoder's cross-attention read
# them. Before the fix the audio was padded to 30 s first and the mask was counted from the padded length, so
# every frame was marked real and the padded frames kept their own quantized embeddings. The fix counts
# audio_frames from the unpadded samples and pads afterwards.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class WhisperDataset(torch.utils.data.Dataset):
    def __init__(self, clips, texts, max_audio_length=30 * 16000, max_tokens=12):
        self.clips, self.texts = clips, texts
        self.max_audio_length = max_audio_length
        self.max_tokens = max_tokens
        self.sot_sequence_including_notimestamps = [1, 2, 3]
        self.eot = 4

    def __len__(self):
        return len(self.clips)

    def pad_audio(self, audio):
        if len(audio) > self.max_audio_length:
            return audio[: self.max_audio_length]
        return F.pad(audio, (0, self.max_audio_length - len(audio)), value=0)

    def __getitem__(self, idx):
        samples = self.clips[idx]
        if samples.abs().max() > 0:
            samples = samples / samples.abs().max()

        if not FIXED:
            # Pad audio
            samples = self.pad_audio(samples)

        # Create mask for attention
        mask = torch.zeros(30 * 16000 // 320, dtype=torch.bool)
        audio_frames = min(len(samples), self.max_audio_length) // 320
        mask[:audio_frames] = 1

        if FIXED:
            # Pad audio
            samples = self.pad_audio(samples)

        tokens = list(self.sot_sequence_including_notimestamps) + self.texts[idx]
        rpad = self.max_tokens - len(tokens)
        in_ttoks = F.pad(torch.tensor(tokens, dtype=torch.long), (0, rpad), value=self.eot)
        out_ttoks = F.pad(torch.tensor(tokens[1:] + [self.eot], dtype=torch.long), (0, rpad), value=-100)
        return samples, mask, in_ttoks, out_ttoks


class Config:
    mask_embs = True
    downsample_mean = True


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.ln2 = nn.LayerNorm(width)

    def forward(self, x, positions):
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyWhisperDecoder(nn.Module):
    def __init__(self, vocab, width, heads, n_ctx=16):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.randn(n_ctx, width) * 0.02)
        self.ln = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.cross_ln = nn.LayerNorm(width)
        self.cross_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_out = nn.LayerNorm(width)
        mask = torch.empty(n_ctx, n_ctx).fill_(-float("inf")).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x, xa):
        n = x.shape[-1]
        x = self.token_embedding(x) + self.positional_embedding[:n]
        h = self.ln(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:n, :n], need_weights=False)[0]
        h = self.cross_ln(x)
        x = x + self.cross_attn(h, xa, xa, need_weights=False)[0]
        x = self.ln_out(x)
        return x @ self.token_embedding.weight.T


class Codebook(nn.Module):
    def __init__(self, codes, dim):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(1, codes, dim))


class RQLayer(nn.Module):
    def __init__(self, width, codebook_dim, codes):
        super().__init__()
        self.project_in = nn.Linear(width, codebook_dim)
        self.project_out = nn.Linear(codebook_dim, width)
        self._codebook = Codebook(codes, codebook_dim)


class RQ(nn.Module):
    def __init__(self, width, codebook_dim, codes):
        super().__init__()
        self.layers = nn.ModuleList([RQLayer(width, codebook_dim, codes)])

    def forward(self, x):
        layer = self.layers[0]
        z = layer.project_in(x)
        emb = layer._codebook.embed[0, :-1]  # the last code is kept for the padding
        d = torch.cdist(z, emb.expand(z.shape[0], -1, -1))
        idx = d.argmin(-1)
        q = emb[idx]
        commit = F.mse_loss(z, q.detach())
        q = z + (q - z).detach()
        return layer.project_out(q), idx.unsqueeze(-1), commit


class RQBottleneckTransformer(nn.Module):
    def __init__(self, width=32, heads=4, vq_codes=16, downsample=2, vocab=24, n_frames=1500):
        super().__init__()
        self.config = Config()
        self.vq_codes = vq_codes
        self.downsample = downsample
        self.encoder = nn.Linear(320, width)  # stand-in for the frozen Whisper encoder, 320 samples a frame
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.mlp_ln = nn.LayerNorm(width)
        self.rq = RQ(width, 8, vq_codes + 1 if self.config.mask_embs else vq_codes)
        self.positional_embedding = nn.Embedding(n_frames, width)
        self.register_buffer("positions", torch.arange(0, n_frames, dtype=torch.long))
        self._out_blocks = nn.ModuleList([Block(width, heads) for _ in range(2)])
        self.ln_post = nn.LayerNorm(width)
        self.decoder = TinyWhisperDecoder(vocab, width, heads)

    def downsample_embeddings(self, x):
        bs, slen, depth = x.shape
        return x.reshape(bs, slen // self.downsample, self.downsample, depth).mean(-2)

    def out_blocks(self, x):
        for l in self._out_blocks:
            x = l(x, self.positions)
        return x

    def _process_quantization(self, embs, mask=None):
        x = self.downsample_embeddings(embs)
        x = x + self.mlp(self.mlp_ln(x))
        quantized, indices, self.commit_loss = self.rq(x)
        self.commit_loss = self.commit_loss.mean()
        x = quantized.repeat_interleave(self.downsample, -2)
        if self.training and self.config.mask_embs and mask is not None:
            project_out = getattr(self.rq, "project_out", None) or self.rq.layers[0].project_out
            x[~mask] = project_out(self.rq.layers[0]._codebook.embed[0, self.vq_codes])
        x = x + self.positional_embedding(self.positions.to(x.device))
        x = self.ln_post(self.out_blocks(x))
        return x

    def forward(self, samples, mask=None, input_toks=None, output_toks=None):
        embs = self.encoder(samples.reshape(samples.shape[0], -1, 320))
        x = self._process_quantization(embs, mask)
        logits = self.decoder(input_toks, x)
        loss = F.cross_entropy(logits.transpose(1, 2), output_toks, ignore_index=-100)
        return logits, loss + self.commit_loss


def main():
    clips = [torch.randn(16000 * 3), torch.randn(16000 * 7 + 123)]
    texts = [[5, 9, 11, 7], [6, 8, 10, 12, 14, 15]]
    ds = WhisperDataset(clips, texts)
    loader = torch.utils.data.DataLoader(ds, batch_size=2)
    model = RQBottleneckTransformer()
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    samples, mask, in_ttoks, out_ttoks = next(iter(loader))
    print("real frames per row:", mask.sum(-1).tolist())
    logits, loss = model(samples, mask, in_ttoks, out_ttoks)
    print("logits[0, -1, :4]:", [round(v, 5) for v in logits[0, -1, :4].tolist()])
    print("loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
