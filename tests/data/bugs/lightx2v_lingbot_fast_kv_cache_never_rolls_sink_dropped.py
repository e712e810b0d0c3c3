# LightX2V (ModelTC/LightX2V#1008, commit 90457e8): lingbot_fast autoregressive KV cache (WanLingbotFastTransformerInfer).
# The KV cache was sized for the whole video even with local_attn_size set, so it never rolled: the attention slice took
# the last local_attn_size frames and the sink frames fell out of the window instead of being kept at the front.
import math
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def causal_rope_apply(x, grid_sizes, freqs, start_frame=0):
    # x: [1, L, n, d]; freqs: complex [1024, d/2] split 3-way (t, h, w) as in Wan
    n, c = x.size(2), x.size(3) // 2
    f, h, w = grid_sizes[0].tolist()
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    xc = torch.view_as_complex(x[0].reshape(f * h * w, n, -1, 2))
    freqs_i = torch.cat([
        freqs[0][start_frame:start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
        freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
        freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
    ], dim=-1).reshape(f * h * w, 1, -1)
    return torch.view_as_real(xc * freqs_i).flatten(2)[None]


def rope_params(max_seq_len, dim, theta=10000):
    freqs = torch.outer(torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).double() / dim))
    return torch.polar(torch.ones_like(freqs), freqs)


class Phase:
    """Weights of one transformer block (the compute_phases[0] of a LightX2V block)."""

    def __init__(self, dim, ffn_dim):
        g = lambda *s: torch.randn(*s) / math.sqrt(s[-1])
        self.wq, self.wk, self.wv, self.wo = g(dim, dim), g(dim, dim), g(dim, dim), g(dim, dim)
        self.w1, self.w2 = g(ffn_dim, dim), g(dim, ffn_dim)
        self.modulation = torch.randn(1, 6, dim) * 0.1

    def norm1(self, x):
        return F.layer_norm(x, x.shape[-1:], eps=1e-6)

    def norm_qk(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SelfForcingScheduler:
    def __init__(self, num_frame_per_block):
        self.num_frame_per_block = num_frame_per_block
        self.seg_index = 0

    def step_pre(self, seg_index, step_index, is_rerun=False):
        self.seg_index = seg_index
        self.step_index = step_index


class WanLingbotFastTransformerInfer:

    def __init__(self, config):
        self.config = config
        sf_config = config["sf_config"]
        self.num_heads = config["num_heads"]
        self.head_dim = config["dim"] // config["num_heads"]
        self.num_frame_per_block = sf_config["num_frame_per_block"]
        self.local_attn_size = sf_config["local_attn_size"]
        self.sink_size = sf_config.get("sink_size", 0)
        self.scheduler = SelfForcingScheduler(self.num_frame_per_block)
        self.dtype = torch.float64
        self.device = "cpu"

    def _sp_world_size(self):
        return 1

    def reinit_caches(self, frame_seq_length, num_output_frames):
        self.frame_seq_length = frame_seq_length
        self._kv_size = frame_seq_length * num_output_frames
        ws = self._sp_world_size()
        cfg_max = self.config.get("sf_config", {}).get("max_attention_size", None)
        if cfg_max is not None:
            self.max_attention_size = cfg_max // ws
        elif self.local_attn_size == -1:
            self.max_attention_size = self._kv_size // ws
        else:
            self.max_attention_size = self.local_attn_size * frame_seq_length // ws
        self._initialize_kv_cache(self.dtype, self.device)

    def _initialize_kv_cache(self, dtype, device):
        kv_cache1 = []
        ws = self._sp_world_size()
        if FIXED:
            if self.local_attn_size != -1:
                kv_cache_size = self.local_attn_size * self.frame_seq_length // ws
            else:
                kv_cache_size = self._kv_size // ws
            self.kv_cache_size = kv_cache_size
        else:
            self.kv_cache_size = self._kv_size // ws
        n, d = self.num_heads, self.head_dim
        for _ in range(self.config["num_layers"]):
            kv_cache1.append({
                "k": torch.zeros((self.kv_cache_size, n, d)).to(dtype).to(device),
                "v": torch.zeros((self.kv_cache_size, n, d)).to(dtype).to(device),
                "global_end_index": torch.tensor([0], dtype=torch.long).to(device),
                "local_end_index": torch.tensor([0], dtype=torch.long).to(device),
            })
        self.kv_cache1 = kv_cache1

    def infer_self_attn_with_kvcache(self, phase, grid_sizes, x, freqs, shift_msa, scale_msa):
        norm1_out = phase.norm1(x) * (1 + scale_msa) + shift_msa
        s, n, d = norm1_out.shape[0], self.num_heads, self.head_dim
        q = phase.norm_qk(norm1_out @ phase.wq.T).view(s, n, d)
        k = phase.norm_qk(norm1_out @ phase.wk.T).view(s, n, d)
        v = (norm1_out @ phase.wv.T).view(s, n, d)

        seg_index = int(self.scheduler.seg_index)
        current_start_frame = seg_index * self.num_frame_per_block
        q = causal_rope_apply(q.unsqueeze(0), grid_sizes, freqs, start_frame=current_start_frame).type_as(v)[0]
        k = causal_rope_apply(k.unsqueeze(0), grid_sizes, freqs, start_frame=current_start_frame).type_as(v)[0]

        num_new_tokens = int(q.size(0))
        current_start = seg_index * num_new_tokens
        current_end = current_start + num_new_tokens
        kv_cache = self.kv_cache1[self.block_idx]
        local_per_frame = num_new_tokens // self.num_frame_per_block if self.num_frame_per_block > 0 else 0
        sink_tokens = self.sink_size * local_per_frame

        global_end = int(kv_cache["global_end_index"].item())
        local_end = int(kv_cache["local_end_index"].item())

        if self.local_attn_size != -1 and (current_end > global_end) and (num_new_tokens + local_end > self.kv_cache_size):
            num_evicted_tokens = num_new_tokens + local_end - self.kv_cache_size
            num_rolled_tokens = local_end - num_evicted_tokens - sink_tokens
            src_start = sink_tokens + num_evicted_tokens
            src_end = src_start + num_rolled_tokens
            dst_start = sink_tokens
            dst_end = dst_start + num_rolled_tokens
            kv_cache["k"][dst_start:dst_end] = kv_cache["k"][src_start:src_end].clone()
            kv_cache["v"][dst_start:dst_end] = kv_cache["v"][src_start:src_end].clone()
            local_end_index = local_end + current_end - global_end - num_evicted_tokens
            local_start_index = local_end_index - num_new_tokens
        else:
            local_end_index = local_end + current_end - global_end
            local_start_index = local_end_index - num_new_tokens

        kv_cache["k"][local_start_index:local_end_index] = k
        kv_cache["v"][local_start_index:local_end_index] = v
        kv_cache["global_end_index"].fill_(current_end)
        kv_cache["local_end_index"].fill_(local_end_index)

        attn_start = max(0, local_end_index - self.max_attention_size)
        attn_k = kv_cache["k"][attn_start:local_end_index]
        attn_v = kv_cache["v"][attn_start:local_end_index]

        # self_attn_1 is flash_attn varlen over a single sequence: plain SDPA with no mask is the same thing
        attn_out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], attn_k.transpose(0, 1)[None],
                                                  attn_v.transpose(0, 1)[None])[0].transpose(0, 1)
        return attn_out.reshape(s, n * d) @ phase.wo.T

    def infer_block_with_kvcache(self, phase, x, embed0, grid_sizes, freqs):
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (phase.modulation + embed0).unbind(1)
        y = self.infer_self_attn_with_kvcache(phase, grid_sizes, x, freqs, shift_msa, scale_msa)
        x = x + y * gate_msa
        h = phase.norm1(x) * (1 + c_scale_msa) + c_shift_msa
        return x + (F.gelu(h @ phase.w1.T, approximate="tanh") @ phase.w2.T) * c_gate_msa

    def infer(self, phases, x, embed0, grid_sizes, freqs):
        for block_idx in range(len(phases)):
            self.block_idx = block_idx
            x = self.infer_block_with_kvcache(phases[block_idx], x, embed0, grid_sizes, freqs)
        return x


# ----------------------------------------------------------------------------- tiny model around the infer class
DIM, HEADS, LAYERS, FFN = 32, 2, 2, 64
H, W = 2, 2                                 # latent tokens per frame after patching
FRAME_SEQ = H * W
NUM_OUT_FRAMES, NFPB = 8, 2
config = {"dim": DIM, "num_heads": HEADS, "num_layers": LAYERS,
          "sf_config": {"num_frame_per_block": NFPB, "local_attn_size": 4, "sink_size": 1}}
phases = [Phase(DIM, FFN) for _ in range(LAYERS)]
patch_in = torch.randn(DIM, 4) / 2.0
t_proj = torch.randn(6 * DIM, DIM) / math.sqrt(DIM)
head_dim = DIM // HEADS
d = head_dim
freqs = torch.cat([rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)),
                   rope_params(1024, 2 * (d // 6))], dim=1)


def embed_t(t):
    half = DIM // 2
    f = torch.exp(-math.log(10000) * torch.arange(half).double() / half)
    e = torch.cat([torch.cos(t * f), torch.sin(t * f)])
    return (F.silu(e) @ t_proj.T).view(1, 6, DIM)


def pre_infer(latents_block):       # [f, FRAME_SEQ, 4] -> tokens
    return latents_block.reshape(-1, 4) @ patch_in.T


def head(x):
    return x @ patch_in                # tied projection back to 4 latent channels


infer = WanLingbotFastTransformerInfer(config)
infer.reinit_caches(FRAME_SEQ, NUM_OUT_FRAMES)
latents = torch.randn(NUM_OUT_FRAMES, FRAME_SEQ, 4)
timesteps = [1000.0, 500.0]
trace = []
with torch.no_grad():
    for segment_idx in range(NUM_OUT_FRAMES // NFPB):
        sl = slice(segment_idx * NFPB, (segment_idx + 1) * NFPB)
        grid_sizes = torch.tensor([[NFPB, H, W]])
        cur = latents[sl]
        for step_index, t in enumerate(timesteps):
            infer.scheduler.step_pre(seg_index=segment_idx, step_index=step_index, is_rerun=False)
            out = head(infer.infer(phases, pre_infer(cur), embed_t(t), grid_sizes, freqs))
            x0 = out.view(NFPB, FRAME_SEQ, 4)
            trace.append((latents[:segment_idx * NFPB].clone(), cur.clone(), t, x0))
            if step_index < len(timesteps) - 1:
                s = timesteps[step_index + 1] / 1000.0
                cur = (1 - s) * x0 + s * torch.randn_like(x0)
        latents[sl] = x0
        # rerun with timestep zero (context_noise = 0) to write the clean block into the KV cache
        infer.scheduler.step_pre(seg_index=segment_idx, step_index=len(timesteps) - 1, is_rerun=True)
        infer.infer(phases, pre_infer(latents[sl]), embed_t(0.0), grid_sizes, freqs)


def reference(context, cur, t):
    """No cache: [clean context | current block] in one pass, each block sees the sink frames plus the most recent
    local_attn_size - sink_size frames up to the end of its own block."""
    la, sk = config["sf_config"]["local_attn_size"], config["sf_config"]["sink_size"]
    n_ctx = context.shape[0]
    T = n_ctx + cur.shape[0]
    x = pre_infer(torch.cat([context, cur], 0))
    frame = torch.arange(T * FRAME_SEQ) // FRAME_SEQ
    block_end = (frame // NFPB + 1) * NFPB
    qf, kf = block_end[:, None], frame[None, :]
    mask = ((kf < qf) & (kf >= qf - (la - sk))) | (kf < sk)
    tok_t = torch.cat([torch.zeros(n_ctx * FRAME_SEQ), torch.full((cur.shape[0] * FRAME_SEQ,), t)])
    emb = {0.0: embed_t(0.0), t: embed_t(t)}
    e0 = torch.where((tok_t == 0)[:, None, None], emb[0.0].expand(len(tok_t), 6, DIM), emb[t].expand(len(tok_t), 6, DIM))
    grid = torch.tensor([[T, H, W]])
    for ph in phases:
        sh, sc, g, csh, csc, cg = (ph.modulation + e0).unbind(1)
        n1 = ph.norm1(x) * (1 + sc) + sh
        s = n1.shape[0]
        q = causal_rope_apply(ph.norm_qk(n1 @ ph.wq.T).view(1, s, HEADS, head_dim), grid, freqs)[0]
        k = causal_rope_apply(ph.norm_qk(n1 @ ph.wk.T).view(1, s, HEADS, head_dim), grid, freqs)[0]
        v = (n1 @ ph.wv.T).view(s, HEADS, head_dim)
        a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask)[0].transpose(0, 1).reshape(s, DIM)
        x = x + (a @ ph.wo.T) * g
        h = ph.norm1(x) * (1 + csc) + csh
        x = x + (F.gelu(h @ ph.w1.T, approximate="tanh") @ ph.w2.T) * cg
    return head(x).view(T, FRAME_SEQ, 4)[n_ctx:]


worst = 0.0
with torch.no_grad():
    for context, cur, t, x0 in trace:
        worst = max(worst, (x0 - reference(context, cur, t)).abs().max().item())
print(f"kv_cache_size={infer.kv_cache_size} tokens; max |cached rollout - sink+window masked reference| = {worst:.3e}")
