# Citation: huggingface/lerobot src/lerobot/policies/pi0/modeling_pi0.py (make_att_2d_masks, PI0Pytorch.embed_prefix /
#   embed_suffix / forward / sample_actions / denoise_step, _prepare_attention_masks_4d); openpi's big_vision scheme.
# Masking: images + padded language form a bidirectional prefix (ar 0), state starts a block (ar 1), the action chunk
#   is one more block (ar 1,0,0..): cumsum(ar) gives prefix-LM/block-causal keep masks AND-ed with pad masks, turned into
#   an additive 4D mask (0 / -2.38e38). At inference the prefix is cached once; suffix queries see prefix pad mask +
#   their own block mask. Padded language positions never serve as keys; their own rows are ignored.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
OPENPI_ATTENTION_MASK_VALUE = -2.3819763e38


def make_att_2d_masks(pad_masks, att_masks):
    if att_masks.ndim != 2:
        raise ValueError(att_masks.ndim)
    if pad_masks.ndim != 2:
        raise ValueError(pad_masks.ndim)
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    return att_2d_masks & pad_2d_masks


def create_sinusoidal_pos_embedding(time, dimension, min_period, max_period, device="cpu"):
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=torch.float64, device=device)
    period = min_period * (max_period / min_period) ** fraction
    scaling_factor = 1.0 / period * 2 * math.pi
    sin_input = scaling_factor[None, :] * time[:, None]
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)


class Layer(nn.Module):
    """One Gemma-style decoder layer run in eager mode (q/k/v, additive mask, softmax)."""
    def __init__(self, d, h):
        super().__init__()
        self.h, self.hd = h, d // h
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, attention_mask, past_kv=None, use_cache=False):
        B, L, _ = x.shape
        hs = self.ln1(x)
        q = self.q_proj(hs).view(B, L, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(hs).view(B, L, self.h, self.hd).transpose(1, 2)
        v = self.v_proj(hs).view(B, L, self.h, self.hd).transpose(1, 2)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.hd ** -0.5
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(B, L, -1)
        x = x + self.o_proj(out)
        x = x + self.mlp(self.ln2(x))
        return x, ((k, v) if use_cache else None)


class PI0Pytorch(nn.Module):
    def __init__(self, d=64, heads=4, n_img=6, vocab=50, state_dim=8, action_dim=6, chunk=5):
        super().__init__()
        self.n_img, self.chunk, self.action_dim = n_img, chunk, action_dim
        self.img_proj = nn.Linear(12, d)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.state_proj = nn.Linear(state_dim, d)
        self.action_in_proj = nn.Linear(action_dim, d)
        self.action_time_mlp_in = nn.Linear(2 * d, d)
        self.action_time_mlp_out = nn.Linear(d, d)
        self.action_out_proj = nn.Linear(d, action_dim)
        self.layers = nn.ModuleList([Layer(d, heads) for _ in range(2)])
        self.d = d

    def _prepare_attention_masks_4d(self, att_2d_masks):
        att_2d_masks_4d = att_2d_masks[:, None, :, :]
        return torch.where(att_2d_masks_4d, 0.0, OPENPI_ATTENTION_MASK_VALUE)

    def embed_prefix(self, images, img_masks, lang_tokens, lang_masks):
        embs, pad_masks, att_masks = [], [], []
        img_emb = self.img_proj(images)
        bsize, num_img_embs = img_emb.shape[:2]
        embs.append(img_emb)
        pad_masks.append(img_masks[:, None].expand(bsize, num_img_embs))
        att_masks += [0] * num_img_embs
        lang_emb = self.embed_tokens(lang_tokens) * math.sqrt(self.d)
        embs.append(lang_emb)
        pad_masks.append(lang_masks)
        att_masks += [0] * lang_emb.shape[1]
        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=torch.bool)[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks

    def embed_suffix(self, state, noisy_actions, timestep):
        embs, pad_masks, att_masks = [], [], []
        state_emb = self.state_proj(state)
        embs.append(state_emb[:, None, :])
        bsize = state_emb.shape[0]
        pad_masks.append(torch.ones(bsize, 1, dtype=torch.bool))
        att_masks += [1]
        time_emb = create_sinusoidal_pos_embedding(timestep, self.d, 4e-3, 4.0).type(state_emb.dtype)
        action_emb = self.action_in_proj(noisy_actions)
        time_emb = time_emb[:, None, :].expand_as(action_emb)
        x = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([action_emb, time_emb], dim=2))))
        embs.append(x)
        pad_masks.append(torch.ones(bsize, self.chunk, dtype=torch.bool))
        att_masks += [1] + [0] * (self.chunk - 1)
        embs = torch.cat(embs, dim=1)
        pad_masks = torch.cat(pad_masks, dim=1)
        att_masks = torch.tensor(att_masks, dtype=embs.dtype)[None, :].expand(bsize, len(att_masks))
        return embs, pad_masks, att_masks

    def run(self, x, mask4d, past=None, use_cache=False):
        cache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, mask4d, None if past is None else past[i], use_cache)
            cache.append(kv)
        return x, cache

    def forward(self, images, img_masks, lang_tokens, lang_masks, state, actions):
        bsize = actions.shape[0]
        noise = torch.randn_like(actions)
        time = torch.rand(bsize) * 0.999 + 0.001
        time_expanded = time[:, None, None]
        x_t = time_expanded * noise + (1 - time_expanded) * actions
        u_t = noise - actions
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(images, img_masks, lang_tokens, lang_masks)
        suffix_embs, suffix_pad_masks, suffix_att_masks = self.embed_suffix(state, x_t, time)
        pad_masks = torch.cat([prefix_pad_masks, suffix_pad_masks], dim=1)
        att_masks = torch.cat([prefix_att_masks.to(suffix_att_masks.dtype), suffix_att_masks], dim=1)
        att_2d_masks = make_att_2d_masks(pad_masks, att_masks)
        att_2d_masks_4d = self._prepare_attention_masks_4d(att_2d_masks)
        out, _ = self.run(torch.cat([prefix_embs, suffix_embs], dim=1), att_2d_masks_4d)
        suffix_out = out[:, -self.chunk:]
        v_t = self.action_out_proj(suffix_out)
        return F.mse_loss(u_t, v_t, reduction="none")

    @torch.no_grad()
    def sample_actions(self, images, img_masks, lang_tokens, lang_masks, state, num_steps=3):
        bsize = state.shape[0]
        noise = torch.randn(bsize, self.chunk, self.action_dim)
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(images, img_masks, lang_tokens, lang_masks)
        prefix_att_2d_masks = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
        prefix_att_2d_masks_4d = self._prepare_attention_masks_4d(prefix_att_2d_masks)
        _, past_key_values = self.run(prefix_embs, prefix_att_2d_masks_4d, use_cache=True)
        dt = -1.0 / num_steps
        x_t = noise
        time = torch.tensor(1.0)
        while time >= -dt / 2:
            v_t = self.denoise_step(state, prefix_pad_masks, past_key_values, x_t, time.expand(bsize))
            x_t = x_t + dt * v_t
            time += dt
        return x_t

    def denoise_step(self, state, prefix_pad_masks, past_key_values, x_t, timestep):
        suffix_embs, suffix_pad_masks, suffix_att_masks = self.embed_suffix(state, x_t, timestep)
        suffix_len = suffix_pad_masks.shape[1]
        batch_size = prefix_pad_masks.shape[0]
        prefix_len = prefix_pad_masks.shape[1]
        prefix_pad_2d_masks = prefix_pad_masks[:, None, :].expand(batch_size, suffix_len, prefix_len)
        suffix_att_2d_masks = make_att_2d_masks(suffix_pad_masks, suffix_att_masks)
        full_att_2d_masks = torch.cat([prefix_pad_2d_masks, suffix_att_2d_masks], dim=2)
        full_att_2d_masks_4d = self._prepare_attention_masks_4d(full_att_2d_masks)
        out, _ = self.run(suffix_embs, full_att_2d_masks_4d, past=past_key_values)
        return self.action_out_proj(out[:, -self.chunk:])


model = PI0Pytorch()
B = 3
images = torch.randn(B, 6, 12)
img_masks = torch.tensor([True, True, False])  # third sample: missing camera -> image tokens are padding
lang_lens = torch.tensor([7, 4, 2])
lang_tokens = torch.randint(1, 50, (B, 7))
lang_masks = torch.arange(7)[None, :] < lang_lens[:, None]
lang_tokens = lang_tokens.masked_fill(~lang_masks, 0)
state = torch.randn(B, 8)
actions = torch.randn(B, 5, 6)
loss = model(images, img_masks, lang_tokens, lang_masks, state, actions).mean()
loss.backward()
acts = model.sample_actions(images, img_masks, lang_tokens, lang_masks, state)
print(f"loss {loss.item():.4f} actions {acts.norm().item():.4f}")
