# Citation: mxu34/prompt-dt @821637a7d03de970053c3636ab5b25460dabb347: prompt_dt/prompt_decision_transformer.py
#   (PromptDecisionTransformer.forward, get_action), prompt_dt/trajectory_gpt2.py (Attention._attn, GPT2Model.forward:
#   `bias` tril buffer, masked_bias -1e4, (1 - mask) * -10000, no wpe), prompt_dt/prompt_seq_trainer.py (train_step_mix),
#   prompt_utils.py @5f665e50f6218a4df97c3f12e3e556c08bac9041 (get_prompt, flatten_prompt, get_prompt_batch, get_batch).
# Prompt-DT: a prompt of `prompt_episode` short segments, each LEFT-padded to `prompt_length`, is flattened per row and
#   prepended to a LEFT-padded (R, s, a) trajectory window of K steps; both 0/1 masks are stacked three times and
#   concatenated, so padding sits at the start of every prompt segment and of the trajectory. GPT-2 adds its causal
#   mask; timestep embeddings stand in for positions. Shrunk: tiny GPT-2 written here in trajectory_gpt2's style,
#   synthetic trajectories for two tasks instead of the mujoco datasets, no gym.
# Checked against: every row run alone with its padding stripped (all-ones masks), and a cut-off run for causality.
import random

import numpy as np
import torch
import torch.nn as nn
import transformers

random.seed(0)
np.random.seed(0)
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, nx, n_ctx, config, scale=False):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((n_ctx, n_ctx), dtype=torch.uint8)).view(1, 1, n_ctx, n_ctx))
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.n_head = config.n_head
        self.split_size = nx
        self.scale = scale
        self.c_attn = transformers.pytorch_utils.Conv1D(3 * nx, nx)
        self.c_proj = transformers.pytorch_utils.Conv1D(nx, nx)

    def _attn(self, q, k, v, attention_mask=None):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / (float(v.size(-1)) ** 0.5)
        nd, ns = w.size(-2), w.size(-1)
        mask = self.bias[:, :, ns - nd: ns, :ns]
        w = torch.where(mask.bool(), w, self.masked_bias.to(w.dtype))
        if attention_mask is not None:
            w = w + attention_mask
        w = nn.Softmax(dim=-1)(w)
        return torch.matmul(w, v)

    def split_heads(self, x, k=False):
        x = x.view(*x.size()[:-1], self.n_head, x.size(-1) // self.n_head)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(*x.size()[:-2], x.size(-2) * x.size(-1))

    def forward(self, hidden_states, attention_mask=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        a = self._attn(self.split_heads(query), self.split_heads(key, k=True), self.split_heads(value), attention_mask)
        return self.c_proj(self.merge_heads(a))


class Block(nn.Module):
    def __init__(self, n_ctx, config, scale=False):
        super().__init__()
        hidden_size = config.n_embd
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = Attention(hidden_size, n_ctx, config, scale)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.c_fc = transformers.pytorch_utils.Conv1D(4 * hidden_size, hidden_size)
        self.c_proj = transformers.pytorch_utils.Conv1D(hidden_size, 4 * hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask) + hidden_states
        return hidden_states + self.c_proj(nn.functional.gelu(self.c_fc(self.ln_2(hidden_states))))


class GPT2Model(nn.Module):
    # the only difference from Huggingface's GPT2Model: no positional embeddings (wpe removed)
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([Block(config.n_ctx, config, scale=True) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds=None, attention_mask=None):
        batch_size = inputs_embeds.shape[0]
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = attention_mask.to(dtype=inputs_embeds.dtype)
            attention_mask = (1.0 - attention_mask) * -10000.0
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask=attention_mask)
        return {"last_hidden_state": self.ln_f(hidden_states)}


class PromptDecisionTransformer(nn.Module):
    def __init__(self, state_dim, act_dim, hidden_size, max_length=None, max_ep_len=4096, action_tanh=True, **kwargs):
        super().__init__()
        self.state_dim = state_dim
        self.act_dim = act_dim
        self.max_length = max_length
        self.hidden_size = hidden_size
        config = transformers.GPT2Config(vocab_size=1, n_embd=hidden_size, **kwargs)
        self.transformer = GPT2Model(config)

        self.embed_timestep = nn.Embedding(max_ep_len, hidden_size)
        self.embed_return = torch.nn.Linear(1, hidden_size)
        self.embed_state = torch.nn.Linear(self.state_dim, hidden_size)
        self.embed_action = torch.nn.Linear(self.act_dim, hidden_size)

        self.prompt_embed_timestep = nn.Embedding(max_ep_len, hidden_size)
        self.prompt_embed_return = torch.nn.Linear(1, hidden_size)
        self.prompt_embed_state = torch.nn.Linear(self.state_dim, hidden_size)
        self.prompt_embed_action = torch.nn.Linear(self.act_dim, hidden_size)

        self.embed_ln = nn.LayerNorm(hidden_size)
        self.predict_state = torch.nn.Linear(hidden_size, self.state_dim)
        self.predict_action = nn.Sequential(
            *([nn.Linear(hidden_size, self.act_dim)] + ([nn.Tanh()] if action_tanh else []))
        )
        self.predict_return = torch.nn.Linear(hidden_size, 1)

    def forward(self, states, actions, rewards, returns_to_go, timesteps, attention_mask=None, prompt=None):
        batch_size, seq_length = states.shape[0], states.shape[1]
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length), dtype=torch.long)

        state_embeddings = self.embed_state(states)
        action_embeddings = self.embed_action(actions)
        returns_embeddings = self.embed_return(returns_to_go)
        time_embeddings = self.embed_timestep(timesteps)

        state_embeddings = state_embeddings + time_embeddings
        action_embeddings = action_embeddings + time_embeddings
        returns_embeddings = returns_embeddings + time_embeddings

        # (R_1, s_1, a_1, R_2, s_2, a_2, ...)
        stacked_inputs = torch.stack(
            (returns_embeddings, state_embeddings, action_embeddings), dim=1
        ).permute(0, 2, 1, 3).reshape(batch_size, 3 * seq_length, self.hidden_size)
        stacked_inputs = self.embed_ln(stacked_inputs)

        stacked_attention_mask = torch.stack(
            (attention_mask, attention_mask, attention_mask), dim=1
        ).permute(0, 2, 1).reshape(batch_size, 3 * seq_length)

        if prompt is not None:
            prompt_states, prompt_actions, prompt_rewards, prompt_dones, prompt_returns_to_go, prompt_timesteps, prompt_attention_mask = prompt
            prompt_seq_length = prompt_states.shape[1]
            prompt_state_embeddings = self.prompt_embed_state(prompt_states)
            prompt_action_embeddings = self.prompt_embed_action(prompt_actions)
            if prompt_returns_to_go.shape[1] % 10 == 1:
                prompt_returns_embeddings = self.prompt_embed_return(prompt_returns_to_go[:, :-1])
            else:
                prompt_returns_embeddings = self.prompt_embed_return(prompt_returns_to_go)
            prompt_time_embeddings = self.prompt_embed_timestep(prompt_timesteps)

            prompt_state_embeddings = prompt_state_embeddings + prompt_time_embeddings
            prompt_action_embeddings = prompt_action_embeddings + prompt_time_embeddings
            prompt_returns_embeddings = prompt_returns_embeddings + prompt_time_embeddings

            prompt_stacked_inputs = torch.stack(
                (prompt_returns_embeddings, prompt_state_embeddings, prompt_action_embeddings), dim=1
            ).permute(0, 2, 1, 3).reshape(prompt_states.shape[0], 3 * prompt_seq_length, self.hidden_size)

            prompt_stacked_attention_mask = torch.stack(
                (prompt_attention_mask, prompt_attention_mask, prompt_attention_mask), dim=1
            ).permute(0, 2, 1).reshape(prompt_states.shape[0], 3 * prompt_seq_length)

            if prompt_stacked_inputs.shape[1] == 3 * seq_length:  # if only sample one prompt
                prompt_stacked_inputs = prompt_stacked_inputs.reshape(1, -1, self.hidden_size)
                prompt_stacked_attention_mask = prompt_stacked_attention_mask.reshape(1, -1)
                stacked_inputs = torch.cat((prompt_stacked_inputs.repeat(batch_size, 1, 1), stacked_inputs), dim=1)
                stacked_attention_mask = torch.cat((prompt_stacked_attention_mask.repeat(batch_size, 1), stacked_attention_mask), dim=1)
            else:  # if sample one prompt for each traj in batch
                stacked_inputs = torch.cat((prompt_stacked_inputs, stacked_inputs), dim=1)
                stacked_attention_mask = torch.cat((prompt_stacked_attention_mask, stacked_attention_mask), dim=1)

        transformer_outputs = self.transformer(inputs_embeds=stacked_inputs, attention_mask=stacked_attention_mask)
        x = transformer_outputs["last_hidden_state"]

        if prompt is None:
            x = x.reshape(batch_size, seq_length, 3, self.hidden_size).permute(0, 2, 1, 3)
        else:
            x = x.reshape(batch_size, -1, 3, self.hidden_size).permute(0, 2, 1, 3)

        # the prompt is prepended to x; only the last seq_length steps belong to the batch
        return_preds = self.predict_return(x[:, 2])[:, -seq_length:, :]
        state_preds = self.predict_state(x[:, 2])[:, -seq_length:, :]
        action_preds = self.predict_action(x[:, 1])[:, -seq_length:, :]
        return state_preds, action_preds, return_preds

    def get_action(self, states, actions, rewards, returns_to_go, timesteps, **kwargs):
        states = states.reshape(1, -1, self.state_dim)
        actions = actions.reshape(1, -1, self.act_dim)
        returns_to_go = returns_to_go.reshape(1, -1, 1)
        timesteps = timesteps.reshape(1, -1)

        if self.max_length is not None:
            states = states[:, -self.max_length:]
            actions = actions[:, -self.max_length:]
            returns_to_go = returns_to_go[:, -self.max_length:]
            timesteps = timesteps[:, -self.max_length:]

            # pad all tokens to sequence length
            attention_mask = torch.cat([torch.zeros(self.max_length - states.shape[1]), torch.ones(states.shape[1])])
            attention_mask = attention_mask.to(dtype=torch.long, device=states.device).reshape(1, -1)
            states = torch.cat(
                [torch.zeros((states.shape[0], self.max_length - states.shape[1], self.state_dim)), states],
                dim=1).to(dtype=torch.float32)
            actions = torch.cat(
                [torch.zeros((actions.shape[0], self.max_length - actions.shape[1], self.act_dim)), actions],
                dim=1).to(dtype=torch.float32)
            returns_to_go = torch.cat(
                [torch.zeros((returns_to_go.shape[0], self.max_length - returns_to_go.shape[1], 1)), returns_to_go],
                dim=1).to(dtype=torch.float32)
            timesteps = torch.cat(
                [torch.zeros((timesteps.shape[0], self.max_length - timesteps.shape[1])), timesteps],
                dim=1).to(dtype=torch.long)
        else:
            attention_mask = None

        _, action_preds, return_preds = self.forward(
            states, actions, None, returns_to_go, timesteps, attention_mask=attention_mask, **kwargs)
        return action_preds[0, -1]


def discount_cumsum(x, gamma):
    out = np.zeros_like(x)
    out[-1] = x[-1]
    for t in reversed(range(x.shape[0] - 1)):
        out[t] = x[t] + gamma * out[t + 1]
    return out


def flatten_prompt(prompt, batch_size):
    p_s, p_a, p_r, p_d, p_rtg, p_timesteps, p_mask = prompt
    p_s = p_s.reshape((batch_size, -1, p_s.shape[-1]))
    p_a = p_a.reshape((batch_size, -1, p_a.shape[-1]))
    p_r = p_r.reshape((batch_size, -1, p_r.shape[-1]))
    p_d = p_d.reshape((batch_size, -1))
    p_rtg = p_rtg[:, :-1, :]
    p_rtg = p_rtg.reshape((batch_size, -1, p_rtg.shape[-1]))
    p_timesteps = p_timesteps.reshape((batch_size, -1))
    p_mask = p_mask.reshape((batch_size, -1))
    return p_s, p_a, p_r, p_d, p_rtg, p_timesteps, p_mask


def pad_segment(traj, si, max_len, info):
    state_dim, act_dim, max_ep_len = info["state_dim"], info["act_dim"], info["max_ep_len"]
    s = traj["observations"][si:si + max_len].reshape(1, -1, state_dim)
    a = traj["actions"][si:si + max_len].reshape(1, -1, act_dim)
    r = traj["rewards"][si:si + max_len].reshape(1, -1, 1)
    d = traj["terminals"][si:si + max_len].reshape(1, -1)
    timesteps = np.arange(si, si + s.shape[1]).reshape(1, -1)
    timesteps[timesteps >= max_ep_len] = max_ep_len - 1  # padding cutoff
    rtg = discount_cumsum(traj["rewards"][si:], gamma=1.)[:s.shape[1] + 1].reshape(1, -1, 1)
    if rtg.shape[1] <= s.shape[1]:
        rtg = np.concatenate([rtg, np.zeros((1, 1, 1))], axis=1)
    tlen = s.shape[1]
    s = np.concatenate([np.zeros((1, max_len - tlen, state_dim)), s], axis=1)
    s = (s - info["state_mean"]) / info["state_std"]
    a = np.concatenate([np.ones((1, max_len - tlen, act_dim)) * -10., a], axis=1)
    r = np.concatenate([np.zeros((1, max_len - tlen, 1)), r], axis=1)
    d = np.concatenate([np.ones((1, max_len - tlen)) * 2, d], axis=1)
    rtg = np.concatenate([np.zeros((1, max_len - tlen, 1)), rtg], axis=1) / info["scale"]
    timesteps = np.concatenate([np.zeros((1, max_len - tlen)), timesteps], axis=1)
    mask = np.concatenate([np.zeros((1, max_len - tlen)), np.ones((1, tlen))], axis=1)
    return s, a, r, d, rtg, timesteps, mask


def to_torch(parts):
    s, a, r, d, rtg, timesteps, mask = (np.concatenate(p, axis=0) for p in parts)
    return (torch.from_numpy(s).float(), torch.from_numpy(a).float(), torch.from_numpy(r).float(),
            torch.from_numpy(d).long(), torch.from_numpy(rtg).float(), torch.from_numpy(timesteps).long(),
            torch.from_numpy(mask))


def get_prompt(prompt_trajectories, info, variant):
    num_episodes, max_len = variant["prompt_episode"], variant["prompt_length"]

    def fn(sample_size=1):
        batch_inds = np.random.choice(np.arange(len(prompt_trajectories)), size=int(num_episodes * sample_size), replace=True)
        parts = [[] for _ in range(7)]
        for i in range(int(num_episodes * sample_size)):
            traj = prompt_trajectories[int(batch_inds[i])]  # stochastic_prompt
            si = max(0, traj["rewards"].shape[0] - max_len - 1)  # select the last traj with length max_len
            for lst, x in zip(parts, pad_segment(traj, si, max_len, info)):
                lst.append(x)
        return to_torch(parts)
    return fn


def get_batch(trajectories, info, variant):
    def fn(batch_size=variant["batch_size"], max_len=variant["K"]):
        batch_inds = np.random.choice(np.arange(len(trajectories)), size=batch_size, replace=True)
        parts = [[] for _ in range(7)]
        for i in range(batch_size):
            traj = trajectories[int(batch_inds[i])]
            si = random.randint(0, traj["rewards"].shape[0] - 1)
            for lst, x in zip(parts, pad_segment(traj, si, max_len, info)):
                lst.append(x)
        return to_torch(parts)
    return fn


def get_prompt_batch(trajectories_list, prompt_trajectories_list, info, variant, train_env_name_list):
    def fn(batch_size=variant["batch_size"]):
        prompts, batches = [], []
        for env_id, env_name in enumerate(train_env_name_list):
            get_prompt_fn = get_prompt(prompt_trajectories_list[env_id], info[env_name], variant)
            get_batch_fn = get_batch(trajectories_list[env_id], info[env_name], variant)
            prompts.append(flatten_prompt(get_prompt_fn(batch_size), batch_size))
            batches.append(get_batch_fn(batch_size=batch_size))
        prompt = tuple(torch.cat(p, dim=0) for p in zip(*prompts))
        batch = tuple(torch.cat(b, dim=0) for b in zip(*batches))
        return prompt, batch
    return fn


state_dim, act_dim, max_ep_len = 4, 2, 50
variant = dict(prompt_episode=2, prompt_length=4, K=5, batch_size=3)
train_env_name_list = ["cheetah_vel-0", "cheetah_vel-1"]


def make_traj(length):
    return {"observations": np.random.randn(length, state_dim), "actions": np.tanh(np.random.randn(length, act_dim)),
            "rewards": np.random.rand(length), "terminals": np.zeros(length)}


trajectories_list = [[make_traj(n) for n in (3, 9, 14)], [make_traj(n) for n in (2, 6, 11)]]
prompt_trajectories_list = [[make_traj(n) for n in (2, 8)], [make_traj(n) for n in (3, 7)]]
info = {name: dict(state_dim=state_dim, act_dim=act_dim, max_ep_len=max_ep_len, scale=10.,
                   state_mean=np.zeros(state_dim), state_std=np.ones(state_dim)) for name in train_env_name_list}

model = PromptDecisionTransformer(state_dim=state_dim, act_dim=act_dim, hidden_size=32, max_length=variant["K"],
                                  max_ep_len=max_ep_len, n_layer=2, n_head=4, n_inner=128, n_ctx=128,
                                  resid_pdrop=0.0, attn_pdrop=0.0)
loss_fn = lambda s_hat, a_hat, r_hat, s, a, r: torch.mean((a_hat - a) ** 2)

# ---- train_step_mix ----
prompt, batch = get_prompt_batch(trajectories_list, prompt_trajectories_list, info, variant, train_env_name_list)()
states, actions, rewards, dones, rtg, timesteps, attention_mask = batch
action_target = torch.clone(actions)
state_preds, action_preds, reward_preds = model.forward(
    states, actions, rewards, rtg[:, :-1], timesteps, attention_mask=attention_mask, prompt=prompt)
act_dim_ = action_preds.shape[2]
kept_preds = action_preds.reshape(-1, act_dim_)[attention_mask.reshape(-1) > 0]
kept_target = action_target.reshape(-1, act_dim_)[attention_mask.reshape(-1) > 0]
loss = loss_fn(None, kept_preds, None, None, kept_target, None)
loss.backward()
print(f"prompt masks {prompt[-1].long().tolist()}")
print(f"batch masks {attention_mask.long().tolist()}")
print(f"train loss {loss.item():.6f}")


# ---- reference: each row alone, its padding stripped ----
def strip(parts, keep):
    return tuple(p[keep][None] for p in parts)


p_s, p_a, p_r, p_d, p_rtg, p_t, p_m = prompt
with torch.no_grad():
    ref_preds = torch.zeros_like(action_preds)
    for b in range(states.shape[0]):
        pk, tk = p_m[b] > 0, attention_mask[b] > 0
        row_prompt = strip((p_s[b], p_a[b], p_r[b], p_d[b], p_rtg[b], p_t[b], p_m[b]), pk)
        s_b, a_b, r_b, rtg_b, t_b = strip((states[b], actions[b], rewards[b], rtg[b, :-1], timesteps[b]), tk)
        _, a_hat, _ = model.forward(s_b, a_b, r_b, rtg_b, t_b, attention_mask=None, prompt=row_prompt)
        ref_preds[b, tk] = a_hat[0]
        # causality: the action read at step t must not depend on anything after s_t
        for t in range(s_b.shape[1]):
            _, a_cut, _ = model.forward(s_b[:, :t + 1], a_b[:, :t + 1], r_b[:, :t + 1], rtg_b[:, :t + 1],
                                        t_b[:, :t + 1], attention_mask=None, prompt=row_prompt)
            torch.testing.assert_close(a_cut[0, -1], a_hat[0, t], atol=1e-5, rtol=1e-5)
    keep = attention_mask > 0
    torch.testing.assert_close(action_preds.detach()[keep], ref_preds[keep], atol=1e-5, rtol=1e-5)
    ref_loss = loss_fn(None, ref_preds[keep], None, None, action_target[keep], None)
    torch.testing.assert_close(loss.detach(), ref_loss, atol=1e-6, rtol=1e-5)

# ---- evaluation rollout: one prompt for the episode, get_action left-pads the history to K ----
model.eval()
eval_prompt = flatten_prompt(get_prompt(prompt_trajectories_list[0], info[train_env_name_list[0]], variant)(), batch_size=1)
ep_pk = eval_prompt[-1][0] > 0
ref_prompt = strip(tuple(p[0] for p in eval_prompt), ep_pk)
ep_states = torch.randn(1, state_dim)
ep_actions = torch.zeros((0, act_dim))
ep_rewards = torch.zeros(0)
target_return = torch.tensor(1.5 / info[train_env_name_list[0]]["scale"]).reshape(1, 1)
ep_timesteps = torch.zeros((1, 1), dtype=torch.long)
with torch.no_grad():
    for t in range(8):
        ep_actions = torch.cat([ep_actions, torch.zeros((1, act_dim))], dim=0)
        ep_rewards = torch.cat([ep_rewards, torch.zeros(1)])
        action = model.get_action(ep_states, ep_actions, ep_rewards, target_return, ep_timesteps, prompt=eval_prompt)
        k0 = max(0, ep_states.shape[0] - variant["K"])
        _, a_ref, _ = model.forward(ep_states[None, k0:], ep_actions[None, k0:], None,
                                    target_return.reshape(1, -1, 1)[:, k0:], ep_timesteps[:, k0:], prompt=ref_prompt)
        torch.testing.assert_close(action, a_ref[0, -1], atol=1e-5, rtol=1e-5)
        ep_actions[-1] = action
        reward = float(action.sum()) * 0.1
        ep_states = torch.cat([ep_states, torch.randn(1, state_dim)], dim=0)
        ep_rewards[-1] = reward
        target_return = torch.cat([target_return, (target_return[0, -1] - reward / 10.).reshape(1, 1)], dim=1)
        ep_timesteps = torch.cat([ep_timesteps, torch.ones((1, 1), dtype=torch.long) * (t + 1)], dim=1)
print(f"eval prompt mask {eval_prompt[-1].long().tolist()}")
print(f"rollout actions norm {ep_actions.norm().item():.4f}")
print("ok: padded prompt + trajectory batch matches the per-row unpadded runs")
