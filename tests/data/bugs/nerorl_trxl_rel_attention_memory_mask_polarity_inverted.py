# MarcoMeter/neroRL commit 65333f0 ("fixed attention mask (added == 0)", branch test/relative_pe): the TrXL policy's
# RelPartialLearnableMultiHeadAttn filled -inf where the memory mask is 1 (valid memory and the query itself), so the
# agent attended only to the invalid (empty / not yet written) memory slots of its episodic memory window.
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class GRUGate(torch.nn.Module):
    def __init__(self, input_dim: int, bg: float = 0.0, swap_inputs: bool = False):
        super(GRUGate, self).__init__()
        self.swap_inputs = swap_inputs
        self.Wr = torch.nn.Linear(input_dim, input_dim, bias=False)
        self.Ur = torch.nn.Linear(input_dim, input_dim, bias=False)
        self.Wz = torch.nn.Linear(input_dim, input_dim, bias=False)
        self.Uz = torch.nn.Linear(input_dim, input_dim, bias=False)
        self.Wg = torch.nn.Linear(input_dim, input_dim, bias=False)
        self.Ug = torch.nn.Linear(input_dim, input_dim, bias=False)
        self.bg = nn.Parameter(torch.full([input_dim], float(bg)))
        self.sigmoid = torch.nn.Sigmoid()
        self.tanh = torch.nn.Tanh()
        for lin in (self.Wr, self.Ur, self.Wz, self.Uz, self.Wg, self.Ug):
            nn.init.xavier_uniform_(lin.weight)

    def forward(self, x, y):
        r = self.sigmoid(self.Wr(y) + self.Ur(x))
        z = self.sigmoid(self.Wz(y) + self.Uz(x) - self.bg)
        h = self.tanh(self.Wg(y) + self.Ug(torch.mul(r, x)))
        return torch.mul(1 - z, x) + torch.mul(z, h)


class RelMultiHeadAttn(nn.Module):
    def __init__(self, d_model, n_head):
        super(RelMultiHeadAttn, self).__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_head = d_model // n_head
        self.values = nn.Linear(self.d_head, self.d_head, bias=False)
        self.keys = nn.Linear(self.d_head, self.d_head, bias=False)
        self.queries = nn.Linear(self.d_head, self.d_head, bias=False)
        self.scale = 1 / (self.d_head ** 0.5)

    def _rel_shift(self, x):
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1)
        x_padded = x_padded.view(x.size(1) + 1, x.size(0), *x.size()[2:])
        x = x_padded[1:].view_as(x)
        return x


class RelPartialLearnableMultiHeadAttn(RelMultiHeadAttn):
    def __init__(self, *args, **kwargs):
        super(RelPartialLearnableMultiHeadAttn, self).__init__(*args, **kwargs)
        self.r_net = nn.Linear(self.d_model, self.n_head * self.d_head, bias=False)

    # value, key, query_, mask
    def forward(self, values, keys, query, attn_mask, r, r_w_bias, r_r_bias):
        bsz = query.shape[0]
        klen, qlen, rlen = keys.shape[1], query.shape[1], r.size(0)
        values = values.reshape(bsz, klen, self.n_head, self.d_head)
        keys = keys.reshape(bsz, klen, self.n_head, self.d_head)
        query = query.reshape(bsz, qlen, self.n_head, self.d_head)
        w_head_v = self.values(values)
        w_head_k = self.keys(keys)
        w_head_q = self.queries(query)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = self.r_net(r)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)
        rw_head_q = w_head_q + r_w_bias
        AC = torch.einsum('ibnd,jbnd->ijbn', (rw_head_q, w_head_k))
        rr_head_q = w_head_q + r_r_bias
        BD = torch.einsum('ibnd,jnd->ijbn', (rr_head_q, r_head_k))
        BD = self._rel_shift(BD)
        attn_score = AC + BD
        attn_score.mul_(self.scale)

        #### compute attention probability
        if FIXED:
            attn_score = attn_score.float().masked_fill(attn_mask.T[None, :, :, None] == 0, -float('inf')).type_as(attn_score)
        else:
            attn_score = attn_score.float().masked_fill(attn_mask.T.bool()[None, :, :, None], -float('inf')).type_as(attn_score)

        attn_prob = F.softmax(attn_score, dim=1)
        attn_vec = torch.einsum('ijbn,jbnd->ibnd', (attn_prob, w_head_v))
        attn_vec = attn_vec.contiguous().view(attn_vec.size(1), attn_vec.size(0), self.n_head * self.d_head)
        return attn_vec, attn_prob


class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super(PositionalEmbedding, self).__init__()
        self.demb = demb
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, pos_seq, bsz=None):
        sinusoid_inp = torch.outer(pos_seq, self.inv_freq)  # torch.ger
        pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)
        if bsz is not None:
            return pos_emb[:, None, :].expand(-1, bsz, -1)
        else:
            return pos_emb if FIXED else pos_emb[:, None, :]


class TransformerBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, share_heads, config):
        super(TransformerBlock, self).__init__()
        self.attention = RelPartialLearnableMultiHeadAttn(embed_dim, num_heads)
        self.use_gtrxl = config["gtrxl"]
        if self.use_gtrxl:
            self.gate1 = GRUGate(embed_dim, config["gtrxl_bias"], config["gtrxl_swap"])
            self.gate2 = GRUGate(embed_dim, config["gtrxl_bias"], config["gtrxl_swap"])
        self.layer_norm = config["layer_norm"]
        self.norm1 = nn.LayerNorm(embed_dim)
        self.norm2 = nn.LayerNorm(embed_dim)
        if self.layer_norm == "pre":
            self.norm_kv = nn.LayerNorm(embed_dim)
        self.fc = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.ReLU())

    def forward(self, value, key, query, mask, r, r_w_bias, r_r_bias):
        if self.layer_norm == "pre":
            query_ = self.norm1(query)
            value = self.norm_kv(value)
        else:
            query_ = query
        value = torch.cat([value, query_], dim=1)
        key = value
        attention, attention_weights = self.attention(value, key, query_, mask, r, r_w_bias, r_r_bias)
        h = self.gate1(query, attention) if self.use_gtrxl else attention + query
        if self.layer_norm == "post":
            h = self.norm1(h)
        h_ = self.norm2(h) if self.layer_norm == "pre" else h
        forward = self.fc(h_)
        out = self.gate2(h, forward) if self.use_gtrxl else forward + h
        if self.layer_norm == "post":
            out = self.norm2(out)
        return out, attention_weights


class Transformer(nn.Module):
    def __init__(self, config, input_dim, activation):
        super().__init__()
        self.config = config
        self.num_blocks = config["num_blocks"]
        self.embed_dim = config["embed_dim"]
        self.num_heads = config["num_heads"]
        self.window_length = config["memory_length"]
        self.head_dim = self.embed_dim // self.num_heads
        self.share_heads = config["share_heads"]
        self.activation = activation
        self.pos_emb = PositionalEmbedding(self.embed_dim)
        self.r_w_bias = nn.Parameter(torch.randn(self.num_heads, self.head_dim) * 0.1)
        self.r_r_bias = nn.Parameter(torch.randn(self.num_heads, self.head_dim) * 0.1)
        self.linear_embedding = nn.Linear(input_dim, self.embed_dim)
        nn.init.orthogonal_(self.linear_embedding.weight, np.sqrt(2))
        self.transformer_blocks = nn.ModuleList([
            TransformerBlock(self.embed_dim, self.num_heads, self.share_heads, config) for _ in range(self.num_blocks)])

    def forward(self, h, memories, mask, memory_indices):
        h = self.activation(self.linear_embedding(h))
        pos_seq = torch.arange(self.window_length, -1, -1.0, device=h.device, dtype=h.dtype)
        pos_emb = self.pos_emb(pos_seq)
        # the query itself is appended to the keys, so it is always a valid key
        mask = torch.cat([mask, torch.ones(mask.size(0), 1)], 1).bool()
        out_memories = []
        for i, block in enumerate(self.transformer_blocks):
            out_memories.append(h.detach())
            h, attention_weights = block(memories[:, :, i], memories[:, :, i], h.unsqueeze(1), mask, pos_emb, self.r_w_bias, self.r_r_bias)
            h = h.squeeze()
            if len(h.shape) == 1:
                h = h.unsqueeze(0)
        return h, torch.stack(out_memories, dim=1)


class ActorCriticModel(nn.Module):
    """Trimmed neroRL actor-critic: vector observation encoder -> TrXL -> policy head."""
    def __init__(self, config, obs_dim, num_actions):
        super().__init__()
        self.encoder = nn.Linear(obs_dim, config["embed_dim"])
        self.transformer = Transformer(config, config["embed_dim"], nn.ReLU())
        self.policy = nn.Linear(config["embed_dim"], num_actions)

    def forward(self, vec_obs, memory, mask, memory_indices):
        h = F.relu(self.encoder(vec_obs))
        h, memory = self.transformer(h, memory, mask, memory_indices)
        return Categorical(logits=self.policy(h)), memory


config = {"num_blocks": 2, "embed_dim": 32, "num_heads": 4, "memory_length": 4, "share_heads": True,
          "gtrxl": True, "gtrxl_bias": 0.0, "gtrxl_swap": False, "layer_norm": "pre"}
max_episode_steps, obs_dim, memory_length = 12, 6, config["memory_length"]
model = ActorCriticModel(config, obs_dim, 3).eval()

# TransformerSampler setup (single worker)
memory = torch.zeros((1, max_episode_steps, config["num_blocks"], config["embed_dim"]))
memory_mask = torch.tril(torch.ones((memory_length, memory_length)), diagonal=-1)
repetitions = torch.repeat_interleave(torch.arange(0, memory_length).unsqueeze(0), memory_length - 1, dim=0).long()
memory_indices = torch.stack([torch.arange(i, i + memory_length) for i in range(max_episode_steps - memory_length + 1)]).long()
memory_indices = torch.cat((repetitions, memory_indices))

observations = torch.randn(max_episode_steps, obs_dim)
max_diff = 0.0
with torch.no_grad():
    for t in range(max_episode_steps):
        mask = memory_mask[min(t, memory_length - 1)].unsqueeze(0)
        indices = memory_indices[t].unsqueeze(0)
        sliced_memory = memory[0, memory_indices[t]].unsqueeze(0)
        policy, new_memory = model(observations[t:t + 1], sliced_memory, mask, indices)
        # Reference: the slots the memory mask marks invalid (0) must not matter; refill them with noise.
        noisy_memory = sliced_memory.clone()
        invalid = mask[0] == 0
        noisy_memory[0, invalid] = torch.randn_like(noisy_memory[0, invalid]) * 3
        policy_ref, _ = model(observations[t:t + 1], noisy_memory, mask, indices)
        max_diff = max(max_diff, (policy.logits - policy_ref.logits).abs().max().item())
        memory[:, t] = new_memory

print("max |policy logits (masked slots empty) - policy logits (masked slots refilled with noise)| = %.6f" % max_diff)
