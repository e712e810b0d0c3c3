# Correct program (quiet batch quiet-yb).
# Ported from k2-fsa/icefall @8936365c5c5d92c89ff26a0aa694d66e75c0f0f8, egs/librispeech/ASR/zipformer/zipformer.py:
# Zipformer2.forward's chunked (simulated-streaming) training path: chunk_size and left_context_frames picked per
# batch, `left_context_chunks = left_context_frames // chunk_size`, `attn_mask = self._get_attn_mask(x, chunk_size,
# left_context_chunks)` (True = masked: a key in a later chunk, or more than left_context_chunks chunks back), the
# padding given as `src_key_padding_mask = make_pad_mask(x_lens)`; RelPositionMultiheadAttentionWeights fills both
# with -1000 on (num_heads, batch, tgt, src) scores and softmaxes; SelfAttention applies the shared weights to its
# own values. Trimmed: the relative-position term, NonlinAttention, the convolution modules, bypass and balancers are
# left out (the positional part is replaced by nothing; ScaledLinear -> nn.Linear; BiasNorm kept as written).
# Layout as icefall: (seq_len, batch, channels), a right-padded batch of fbank-like frames with lengths x_lens.
# Self-check: each utterance run alone on its own frames (no padding, its own chunk mask over its own length); the
# batch's real frames must match. Also a double loop that rebuilds the chunk/left-context mask frame by frame from
# the stated sizes, and a check that perturbing later chunks leaves earlier frames' outputs unchanged.
import torch
import torch.nn as nn

torch.manual_seed(0)


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    """True = padding, as icefall's icefall/utils.py make_pad_mask."""
    assert lengths.ndim == 1, lengths.ndim
    max_len = max(max_len, lengths.max())
    n = lengths.size(0)
    seq_range = torch.arange(0, max_len, device=lengths.device)
    expaned_lengths = seq_range.unsqueeze(0).expand(n, max_len)
    return expaned_lengths >= lengths.unsqueeze(-1)


class BiasNorm(nn.Module):
    def __init__(self, num_channels: int, channel_dim: int = -1, log_scale: float = 1.0):
        super().__init__()
        self.num_channels = num_channels
        self.channel_dim = channel_dim
        self.log_scale = nn.Parameter(torch.tensor(log_scale))
        self.bias = nn.Parameter(torch.empty(num_channels).normal_(mean=0, std=1e-4))

    def forward(self, x):
        channel_dim = self.channel_dim
        if channel_dim < 0:
            channel_dim += x.ndim
        bias = self.bias
        for _ in range(channel_dim + 1, x.ndim):
            bias = bias.unsqueeze(-1)
        scales = (torch.mean((x - bias) ** 2, dim=channel_dim, keepdim=True) ** -0.5) * self.log_scale.exp()
        return x * scales


class RelPositionMultiheadAttentionWeights(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, query_head_dim: int, dropout: float = 0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.query_head_dim = query_head_dim
        self.dropout = dropout
        key_head_dim = query_head_dim
        in_proj_dim = (query_head_dim + key_head_dim) * num_heads
        self.in_proj = nn.Linear(embed_dim, in_proj_dim, bias=True)

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        (seq_len, batch_size, _) = x.shape
        x = self.in_proj(x)
        query_head_dim = self.query_head_dim
        num_heads = self.num_heads

        query_dim = query_head_dim * num_heads
        q = x[..., 0:query_dim]
        k = x[..., query_dim: 2 * query_dim]

        q = q.reshape(seq_len, batch_size, num_heads, query_head_dim)
        k = k.reshape(seq_len, batch_size, num_heads, query_head_dim)

        # time1 refers to target, time2 refers to source.
        q = q.permute(2, 1, 0, 3)  # (head, batch, time1, query_head_dim)
        k = k.permute(2, 1, 3, 0)  # (head, batch, d_k, time2)

        attn_scores = torch.matmul(q, k) * (query_head_dim ** -0.5)

        assert attn_scores.shape == (num_heads, batch_size, seq_len, seq_len)

        if attn_mask is not None:
            assert attn_mask.dtype == torch.bool
            # use -1000 to avoid nan's where attn_mask and key_padding_mask make
            # all scores zero.
            attn_scores = attn_scores.masked_fill(attn_mask, -1000)

        if key_padding_mask is not None:
            assert key_padding_mask.shape == (batch_size, seq_len), key_padding_mask.shape
            attn_scores = attn_scores.masked_fill(key_padding_mask.unsqueeze(1), -1000)

        attn_weights = attn_scores.softmax(dim=-1)
        return attn_weights


class SelfAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, value_head_dim: int):
        super().__init__()
        self.in_proj = nn.Linear(embed_dim, num_heads * value_head_dim, bias=True)
        self.out_proj = nn.Linear(num_heads * value_head_dim, embed_dim, bias=True)

    def forward(self, x, attn_weights):
        (seq_len, batch_size, embed_dim) = x.shape
        num_heads = attn_weights.shape[0]
        assert attn_weights.shape == (num_heads, batch_size, seq_len, seq_len)

        x = self.in_proj(x)  # (seq_len, batch_size, num_heads * value_head_dim)
        x = x.reshape(seq_len, batch_size, num_heads, -1).permute(2, 1, 0, 3)
        # now x: (num_heads, batch_size, seq_len, value_head_dim)
        value_head_dim = x.shape[-1]

        x = torch.matmul(attn_weights, x)
        # v: (num_heads, batch_size, seq_len, value_head_dim)

        x = x.permute(2, 1, 0, 3).contiguous().view(seq_len, batch_size, num_heads * value_head_dim)

        x = self.out_proj(x)
        return x


class FeedforwardModule(nn.Module):
    def __init__(self, embed_dim: int, feedforward_dim: int):
        super().__init__()
        self.in_proj = nn.Linear(embed_dim, feedforward_dim)
        self.out_proj = nn.Linear(feedforward_dim, embed_dim)

    def forward(self, x):
        return self.out_proj(torch.nn.functional.silu(self.in_proj(x)))


class Zipformer2EncoderLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, query_head_dim, value_head_dim, feedforward_dim):
        super().__init__()
        self.self_attn_weights = RelPositionMultiheadAttentionWeights(embed_dim, num_heads, query_head_dim)
        self.self_attn1 = SelfAttention(embed_dim, num_heads, value_head_dim)
        self.self_attn2 = SelfAttention(embed_dim, num_heads, value_head_dim)
        self.feed_forward1 = FeedforwardModule(embed_dim, (feedforward_dim * 3) // 4)
        self.feed_forward2 = FeedforwardModule(embed_dim, feedforward_dim)
        self.feed_forward3 = FeedforwardModule(embed_dim, (feedforward_dim * 5) // 4)
        self.norm = BiasNorm(embed_dim)

    def forward(self, src, chunk_size=-1, attn_mask=None, src_key_padding_mask=None):
        # attn_weights: (num_heads, batch_size, seq_len, seq_len)
        attn_weights = self.self_attn_weights(src, attn_mask=attn_mask, key_padding_mask=src_key_padding_mask)
        src = src + self.feed_forward1(src)
        src = src + self.self_attn1(src, attn_weights)
        src = src + self.feed_forward2(src)
        src = src + self.self_attn2(src, attn_weights)
        src = src + self.feed_forward3(src)
        src = self.norm(src)
        return src


class Zipformer2(nn.Module):
    def __init__(self, feature_dim=20, encoder_dim=32, num_layers=2, num_heads=4, query_head_dim=8,
                 value_head_dim=6, feedforward_dim=64, chunk_size=(4,), left_context_frames=(8,)):
        super().__init__()
        self.encoder_dim = (encoder_dim,)
        self.downsampling_factor = (1,)
        self.cnn_module_kernel = (3,)
        self.chunk_size = chunk_size
        self.left_context_frames = left_context_frames
        self.encoder_embed = nn.Linear(feature_dim, encoder_dim)
        self.encoders = nn.ModuleList([
            Zipformer2EncoderLayer(encoder_dim, num_heads, query_head_dim, value_head_dim, feedforward_dim)
            for _ in range(num_layers)
        ])

    def get_chunk_info(self):
        # training samples one of the configured values; here one of each
        chunk_size = self.chunk_size[0]
        left_context_chunks = self.left_context_frames[0] // chunk_size
        return chunk_size, left_context_chunks

    def forward(self, x, x_lens, src_key_padding_mask=None):
        chunk_size, left_context_chunks = self.get_chunk_info()
        attn_mask = self._get_attn_mask(x, chunk_size, left_context_chunks)
        for module in self.encoders:
            x = module(x, chunk_size=chunk_size, attn_mask=attn_mask, src_key_padding_mask=src_key_padding_mask)
        return x, x_lens

    def _get_attn_mask(self, x, chunk_size, left_context_chunks):
        """(seq_len, seq_len), (tgt_seq_len, src_seq_len); True means a masked position."""
        if chunk_size <= 0:
            return None
        assert all(chunk_size % d == 0 for d in self.downsampling_factor)
        if left_context_chunks >= 0:
            num_encoders = len(self.encoder_dim)
            assert all(
                chunk_size * left_context_chunks >= (self.cnn_module_kernel[i] // 2) * self.downsampling_factor[i]
                for i in range(num_encoders)
            )
        else:
            left_context_chunks = 1000000

        seq_len = x.shape[0]

        # t is frame index, shape (seq_len,)
        t = torch.arange(seq_len, dtype=torch.int32, device=x.device)
        # c is chunk index for each frame, shape (seq_len,)
        c = t // chunk_size
        src_c = c
        tgt_c = c.unsqueeze(-1)

        attn_mask = torch.logical_or(src_c > tgt_c, src_c < tgt_c - left_context_chunks)
        return attn_mask


# ---- forward_encoder as in train.py: features (N, T, C) -> (T, N, C) -------------------------------------------
model = Zipformer2().eval()
x_lens = torch.tensor([19, 11, 6])
T = int(x_lens.max())
feats = torch.randn(len(x_lens), T, 20)
feats = feats.masked_fill(make_pad_mask(x_lens, T).unsqueeze(-1), 0.0)  # lhotse pads fbank frames with zeros


def encode(feats, x_lens):
    x = model.encoder_embed(feats)
    src_key_padding_mask = make_pad_mask(x_lens, x.shape[1])
    x = x.permute(1, 0, 2)  # (N, T, C) -> (T, N, C)
    encoder_out, encoder_out_lens = model(x, x_lens, src_key_padding_mask)
    return encoder_out.permute(1, 0, 2), encoder_out_lens


with torch.no_grad():
    out, out_lens = encode(feats, x_lens)
    assert torch.isfinite(out).all()

    # reference 1: each utterance alone, its own frames only
    for i, n in enumerate(x_lens.tolist()):
        ref, _ = encode(feats[i:i + 1, :n], x_lens[i:i + 1])
        assert torch.allclose(out[i, :n], ref[0], atol=1e-5), (i, (out[i, :n] - ref[0]).abs().max())

    # reference 2: the chunk mask rebuilt frame by frame from the stated sizes (chunks of 4 frames, 8 frames of
    # left context = 2 whole chunks back, look-ahead to the end of the own chunk)
    CHUNK, LEFT_FRAMES = 4, 8
    chunk_size, left_chunks = model.get_chunk_info()
    mask = model._get_attn_mask(torch.zeros(T, 1, 1), chunk_size, left_chunks)
    for q in range(T):
        for k in range(T):
            visible = (k // CHUNK <= q // CHUNK) and (k // CHUNK * CHUNK >= q // CHUNK * CHUNK - LEFT_FRAMES)
            assert bool(mask[q, k]) == (not visible), (q, k)

    # reference 3: frames of later chunks never reach the earlier ones (through both layers)
    feats2 = feats.clone()
    feats2[0, 8:19] += 3.0 * torch.randn(11, 20)
    out2, _ = encode(feats2, x_lens)
    assert torch.allclose(out2[0, :8], out[0, :8], atol=1e-6)
    assert not torch.allclose(out2[0, 8:12], out[0, 8:12], atol=1e-3)
    assert torch.allclose(out2[1:], out[1:], atol=1e-6)

print("ok: chunked zipformer layers over", tuple(x_lens.tolist()), "frames match each utterance alone")
