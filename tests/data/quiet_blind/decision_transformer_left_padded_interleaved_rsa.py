"""Decision Transformer (kzl/decision-transformer, gym/) acting online with a left-padded context window.

Follows gym/decision_transformer/models/decision_transformer.py (forward: stacked_inputs interleave
(return-to-go, state, action) per timestep, `stacked_attention_mask = torch.stack((attention_mask,
attention_mask, attention_mask), dim=1).permute(0, 2, 1).reshape(batch_size, 3*seq_length)`;
get_action: keep the last max_length steps and LEFT-pad with zeros, attention_mask = [0]*pad + [1]*len)
and trajectory_gpt2.py (GPT-2 causal `bias` buffer plus the extended mask `(1.0 - mask) * -10000.0`).
The mask: causal over the 3*K interleaved tokens, with the padded timesteps' three tokens hidden as
keys; the action is read from the state token of the last real step.
"""
import math

import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, n_ctx):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((n_ctx, n_ctx), dtype=torch.uint8)).view(1, 1, n_ctx, n_ctx))
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.n_head = n_head
        self.split_size = n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def _attn(self, q, k, v, attention_mask=None):
        w = torch.matmul(q, k)
        w = w / (float(v.size(-1)) ** 0.5)
        nd, ns = w.size(-2), w.size(-1)
        mask = self.bias[:, :, ns - nd:ns, :ns]
        w = torch.where(mask.bool(), w, self.masked_bias.to(w.dtype))
        if attention_mask is not None:
            w = w + attention_mask
        w = nn.Softmax(dim=-1)(w)
        return torch.matmul(w, v)

    def split_heads(self, x, k=False):
        new_x_shape = x.size()[:-1] + (self.n_head, x.size(-1) // self.n_head)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        a = self._attn(self.split_heads(query), self.split_heads(key, k=True), self.split_heads(value), attention_mask)
        a = a.permute(0, 2, 1, 3).contiguous()
        a = a.view(*a.size()[:-2], a.size(-2) * a.size(-1))
        return self.c_proj(a)


class GPT2Model(nn.Module):
    """trajectory_gpt2.GPT2Model without wpe: positions come from the timestep embedding."""

    def __init__(self, n_embd, n_head, n_layer, n_ctx):
        super().__init__()
        self.h = nn.ModuleList([Attention(n_embd, n_head, n_ctx) for _ in range(n_layer)])
        self.ln = nn.ModuleList([nn.LayerNorm(n_embd) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, inputs_embeds, attention_mask):
        batch_size = inputs_embeds.shape[0]
        attention_mask = attention_mask.view(batch_size, -1)[:, None, None, :]
        attention_mask = (1.0 - attention_mask.to(inputs_embeds.dtype)) * -10000.0
        h = inputs_embeds
        for ln, block in zip(self.ln, self.h):
            h = h + block(ln(h), attention_mask=attention_mask)
        return self.ln_f(h)


class DecisionTransformer(nn.Module):
    def __init__(self, state_dim, act_dim, hidden_size, max_length=None, max_ep_len=1000, **kwargs):
        super().__init__()
        self.state_dim, self.act_dim, self.max_length, self.hidden_size = state_dim, act_dim, max_length, hidden_size
        self.transformer = GPT2Model(hidden_size, kwargs["n_head"], kwargs["n_layer"], 3 * max_length)
        self.embed_timestep = nn.Embedding(max_ep_len, hidden_size)
        self.embed_return = nn.Linear(1, hidden_size)
        self.embed_state = nn.Linear(state_dim, hidden_size)
        self.embed_action = nn.Linear(act_dim, hidden_size)
        self.embed_ln = nn.LayerNorm(hidden_size)
        self.predict_action = nn.Sequential(nn.Linear(hidden_size, act_dim), nn.Tanh())

    def forward(self, states, actions, rewards, returns_to_go, timesteps, attention_mask=None):
        batch_size, seq_length = states.shape[0], states.shape[1]
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length), dtype=torch.long)
        time_embeddings = self.embed_timestep(timesteps)
        state_embeddings = self.embed_state(states) + time_embeddings
        action_embeddings = self.embed_action(actions) + time_embeddings
        returns_embeddings = self.embed_return(returns_to_go) + time_embeddings
        stacked_inputs = torch.stack((returns_embeddings, state_embeddings, action_embeddings), dim=1
                                     ).permute(0, 2, 1, 3).reshape(batch_size, 3 * seq_length, self.hidden_size)
        stacked_inputs = self.embed_ln(stacked_inputs)
        stacked_attention_mask = torch.stack((attention_mask, attention_mask, attention_mask), dim=1
                                             ).permute(0, 2, 1).reshape(batch_size, 3 * seq_length)
        x = self.transformer(inputs_embeds=stacked_inputs, attention_mask=stacked_attention_mask)
        x = x.reshape(batch_size, seq_length, 3, self.hidden_size).permute(0, 2, 1, 3)
        return self.predict_action(x[:, 1])  # predict next action given state

    def get_action(self, states, actions, rewards, returns_to_go, timesteps):
        states = states.reshape(1, -1, self.state_dim)
        actions = actions.reshape(1, -1, self.act_dim)
        returns_to_go = returns_to_go.reshape(1, -1, 1)
        timesteps = timesteps.reshape(1, -1)
        states, actions = states[:, -self.max_length:], actions[:, -self.max_length:]
        returns_to_go, timesteps = returns_to_go[:, -self.max_length:], timesteps[:, -self.max_length:]
        pad = self.max_length - states.shape[1]
        attention_mask = torch.cat([torch.zeros(pad), torch.ones(states.shape[1])]).to(dtype=torch.long).reshape(1, -1)
        states = torch.cat([torch.zeros((1, pad, self.state_dim)), states], dim=1).float()
        actions = torch.cat([torch.zeros((1, pad, self.act_dim)), actions], dim=1).float()
        returns_to_go = torch.cat([torch.zeros((1, pad, 1)), returns_to_go], dim=1).float()
        timesteps = torch.cat([torch.zeros((1, pad), dtype=torch.long), timesteps], dim=1)
        action_preds = self.forward(states, actions, None, returns_to_go, timesteps, attention_mask=attention_mask)
        return action_preds[0, -1]


def main():
    torch.manual_seed(0)
    state_dim, act_dim, K = 5, 2, 4
    model = DecisionTransformer(state_dim, act_dim, hidden_size=32, max_length=K, n_layer=2, n_head=2).eval()
    # evaluate_episode_rtg: the context grows by one step per env step; early steps are left-padded.
    states = torch.randn(1, state_dim)
    actions = torch.zeros((0, act_dim))
    target_return = torch.tensor([[3.6]])
    timesteps = torch.zeros((1, 1), dtype=torch.long)
    with torch.no_grad():
        for t in range(6):
            actions = torch.cat([actions, torch.zeros((1, act_dim))], dim=0)
            action = model.get_action(states, actions, None, target_return, timesteps)
            actions[-1] = action
            reward = float(-action.pow(2).sum())
            states = torch.cat([states, torch.randn(1, state_dim)], dim=0)
            target_return = torch.cat([target_return, (target_return[0, -1] - reward).reshape(1, 1)], dim=1)
            timesteps = torch.cat([timesteps, torch.ones((1, 1), dtype=torch.long) * (t + 1)], dim=1)
    print("last action", [round(a, 4) for a in action.tolist()])


if __name__ == "__main__":
    main()
