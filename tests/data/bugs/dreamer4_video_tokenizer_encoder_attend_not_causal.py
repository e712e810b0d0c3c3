# lucidrains/dreamer4#2 (fixed in c056835): the VideoTokenizer built its encoder/decoder attend fns without
# causal=True and with num_special_tokens=0, so frames saw future frames and the latent-token mask was never applied.
import sys
from functools import partial
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(v):
    return v is not None


def default(v, d):
    return v if exists(v) else d


def naive_attend(q, k, v, softclamp_value=None, scale=None, causal=False, causal_block_size=1, mask=None):
    scale = default(scale, q.shape[-1] ** -0.5)
    sim = torch.einsum('b h i d, b h j d -> b h i j', q, k) * scale
    if exists(softclamp_value):
        sim = (sim / softclamp_value).tanh() * softclamp_value
    mask_value = -torch.finfo(sim.dtype).max
    if exists(mask):
        sim = sim.masked_fill(~mask, mask_value)
    if causal:
        i, j = sim.shape[-2:]
        if causal_block_size > 1:
            i, j = -(-i // causal_block_size), -(-j // causal_block_size)
        causal_mask = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
        if causal_block_size > 1:
            causal_mask = causal_mask.repeat_interleave(causal_block_size, 0).repeat_interleave(causal_block_size, 1)
            causal_mask = causal_mask[:sim.shape[-2], :sim.shape[-1]]
        sim = sim.masked_fill(causal_mask, mask_value)
    attn = sim.softmax(dim=-1)
    return torch.einsum('b h i j, b h j d -> b h i d', attn, v)


def special_token_mask(q, k, seq_len, num_tokens, special_attend_only_itself=False):
    is_special_start_index = seq_len - num_tokens
    q_is_special = q >= is_special_start_index
    k_is_special = k >= is_special_start_index
    if special_attend_only_itself:
        return ~(q_is_special & ~k_is_special)
    return ~(~q_is_special & k_is_special)


def get_attend_fn(use_flex, seq_len, k_seq_len, causal=False, causal_block_size=1, softclamp_value=50.,
                  num_special_tokens=0, block_size_per_special=None, special_attend_only_itself=False):
    block_size_per_special = default(block_size_per_special, k_seq_len)
    mask = None
    if num_special_tokens > 0:
        q_seq = torch.arange(seq_len)[:, None]
        k_seq = torch.arange(k_seq_len)[None, :]
        mask = special_token_mask(q_seq, k_seq, block_size_per_special, num_special_tokens, special_attend_only_itself)
    return partial(naive_attend, causal=causal, causal_block_size=causal_block_size, mask=mask,
                   softclamp_value=softclamp_value)


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8):
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, tokens, attend_fn):
        b, n, _ = tokens.shape
        q, k, v = self.to_qkv(self.norm(tokens)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = attend_fn(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class VideoTokenizer(nn.Module):
    def __init__(self, dim=16, patch_dim=12, num_latent_tokens=1, depth=2):
        super().__init__()
        self.num_latent_tokens = num_latent_tokens
        self.patch_to_tokens = nn.Linear(patch_dim, dim)
        self.latent_tokens = nn.Parameter(torch.randn(num_latent_tokens, dim))
        self.encoder_layers = nn.ModuleList([Attention(dim) for _ in range(depth)])
        self.attn_softclamp_value = 50.

    def encode(self, patches):  # (b, t, n_patches, patch_dim)
        b, t = patches.shape[:2]
        tokens = self.patch_to_tokens(patches)
        latents = self.latent_tokens.expand(b, t, -1, -1)
        tokens = torch.cat((tokens, latents), dim=2)  # pack space: patches then latents
        space_seq_len = tokens.shape[-2]
        tokens = tokens.reshape(b, -1, tokens.shape[-1])  # pack time
        seq_len = tokens.shape[1]

        attend_kwargs = dict(causal=True, causal_block_size=space_seq_len, softclamp_value=self.attn_softclamp_value,
                             block_size_per_special=space_seq_len, num_special_tokens=1)

        use_flex = False
        # modality can only attend to itself while latents can attend to everything
        if FIXED:
            encoder_attend_fn = get_attend_fn(use_flex, seq_len, seq_len, causal=True,
                                              num_special_tokens=self.num_latent_tokens,
                                              special_attend_only_itself=False)
        else:
            encoder_attend_fn = get_attend_fn(use_flex, seq_len, seq_len, special_attend_only_itself=False)

        for attn in self.encoder_layers:
            tokens = attn(tokens, attend_fn=encoder_attend_fn) + tokens

        tokens = tokens.view(b, t, space_seq_len, -1)
        return tokens[:, :, -self.num_latent_tokens:]


model = VideoTokenizer().eval()
video = torch.randn(1, 3, 4, 12)  # 3 frames, 4 patches each
perturbed = video.clone()
perturbed[:, 2] += 1.0  # change only the last frame

with torch.no_grad():
    lat = model.encode(video)
    lat_p = model.encode(perturbed)

leak = (lat[:, 0] - lat_p[:, 0]).abs().max().item()
print(f"fixed={FIXED} change of frame-0 latent when only frame 2 changes: {leak:.3e}")
