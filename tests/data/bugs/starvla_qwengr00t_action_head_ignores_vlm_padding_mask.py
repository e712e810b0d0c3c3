# starVLA/starVLA PR #315 (commit b6ab70e, answers issue #330): Qwen_GR00T called the GR00T flow-matching
# action head without the VLM's attention_mask, so the DiT cross-attention attended to the padded
# positions of the batched prompt's hidden states; the fix passes encoder_attention_mask=backbone_attention_mask.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, HEADS, VOCAB, PAD = 32, 4, 50, 0


class Attention(nn.Module):
    """diffusers Attention + AttnProcessor2_0, trimmed: (B, S) mask -> (B, heads, 1, S), SDPA."""

    def __init__(self, query_dim, heads, dim_head, cross_attention_dim=None):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        kv_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(kv_dim, inner)
        self.to_v = nn.Linear(kv_dim, inner)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B = hidden_states.shape[0]
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        if attention_mask is not None:
            S = encoder_hidden_states.shape[1]
            attention_mask = attention_mask.repeat_interleave(self.heads, dim=0)  # prepare_attention_mask
            attention_mask = attention_mask.view(B, self.heads, -1, S)
        q = self.to_q(hidden_states).view(B, -1, self.heads, D // self.heads).transpose(1, 2)
        k = self.to_k(encoder_hidden_states).view(B, -1, self.heads, D // self.heads).transpose(1, 2)
        v = self.to_v(encoder_hidden_states).view(B, -1, self.heads, D // self.heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.to_out(out.transpose(1, 2).reshape(B, -1, D))


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, heads, cross_attention_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, dim // heads, cross_attention_dim=cross_attention_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, temb=None):
        norm_hidden_states = self.norm1(hidden_states) + temb[:, None]
        attn_output = self.attn1(
            norm_hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
        )
        hidden_states = attn_output + hidden_states
        hidden_states = self.ff(self.norm3(hidden_states)) + hidden_states
        return hidden_states


class DiT(nn.Module):
    def __init__(self, num_layers=4, interleave_self_attention=True):
        super().__init__()
        self.interleave_self_attention = interleave_self_attention
        self.timestep_encoder = nn.Embedding(1000, D)
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(D, HEADS, None if (i % 2 == 1 and interleave_self_attention) else D)
            for i in range(num_layers)
        )
        self.proj_out_2 = nn.Linear(D, D)

    def forward(self, hidden_states, encoder_hidden_states, timestep=None, return_all_hidden_states=False,
                encoder_attention_mask=None):
        temb = self.timestep_encoder(timestep)
        for idx, block in enumerate(self.transformer_blocks):
            if idx % 2 == 1 and self.interleave_self_attention:
                hidden_states = block(hidden_states, attention_mask=None, encoder_hidden_states=None,
                                      encoder_attention_mask=None, temb=temb)
            else:
                hidden_states = block(hidden_states, attention_mask=None,
                                      encoder_hidden_states=encoder_hidden_states,
                                      encoder_attention_mask=encoder_attention_mask, temb=temb)
        return self.proj_out_2(hidden_states)


class FlowmatchingActionHead(nn.Module):
    def __init__(self, action_dim=4, action_horizon=6, num_inference_timesteps=4, num_timestep_buckets=1000):
        super().__init__()
        self.action_dim, self.action_horizon = action_dim, action_horizon
        self.num_inference_timesteps, self.num_timestep_buckets = num_inference_timesteps, num_timestep_buckets
        self.model = DiT()
        self.action_encoder_in = nn.Linear(action_dim, D)
        self.state_encoder = nn.Linear(action_dim, D)
        self.action_decoder = nn.Linear(D, action_dim)
        self.future_tokens = nn.Embedding(2, D)
        self.position_embedding = nn.Embedding(action_horizon, D)

    def action_encoder(self, actions, timesteps):
        return self.action_encoder_in(actions) + self.model.timestep_encoder(timesteps)[:, None]

    @torch.no_grad()
    def predict_action(self, vl_embs, state=None, encoder_attention_mask=None):
        batch_size = vl_embs.shape[0]
        actions = torch.randn(size=(batch_size, self.action_horizon, self.action_dim), dtype=vl_embs.dtype)
        num_steps = self.num_inference_timesteps
        dt = 1.0 / num_steps
        state_features = self.state_encoder(state) if state is not None else None
        for t in range(num_steps):
            t_discretized = int(t / float(num_steps) * self.num_timestep_buckets)
            timesteps_tensor = torch.full(size=(batch_size,), fill_value=t_discretized)
            action_features = self.action_encoder(actions, timesteps_tensor)
            action_features = action_features + self.position_embedding(torch.arange(self.action_horizon))[None]
            future_tokens = self.future_tokens.weight.unsqueeze(0).expand(batch_size, -1, -1)
            sa_embs = torch.cat((state_features, future_tokens, action_features), dim=1)
            model_output = self.model(hidden_states=sa_embs, encoder_hidden_states=vl_embs,
                                      encoder_attention_mask=encoder_attention_mask, timestep=timesteps_tensor)
            pred = self.action_decoder(model_output)
            pred_velocity = pred[:, -self.action_horizon:]
            actions = actions + dt * pred_velocity
        return actions


class QwenVLInterface(nn.Module):
    """Stand-in for the Qwen-VL backbone: a causal decoder layer honouring its own attention_mask."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)

    def build_qwenvl_inputs(self, instructions):
        L = max(len(x) for x in instructions)
        ids = torch.full((len(instructions), L), PAD)
        attn = torch.zeros(len(instructions), L, dtype=torch.long)
        for i, x in enumerate(instructions):  # right padding
            ids[i, : len(x)] = torch.tensor(x)
            attn[i, : len(x)] = 1
        return {"input_ids": ids, "attention_mask": attn}

    def forward(self, input_ids, attention_mask, output_hidden_states=True):
        L = input_ids.shape[1]
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
        h = self.layer(self.embed(input_ids), src_mask=causal, src_key_padding_mask=attention_mask == 0)
        return {"hidden_states": [h]}


class Qwen_GR00T(nn.Module):
    def __init__(self):
        super().__init__()
        self.qwen_vl_interface = QwenVLInterface()
        self.action_model = FlowmatchingActionHead()

    @torch.no_grad()
    def predict_action(self, instructions, state):
        qwen_inputs = self.qwen_vl_interface.build_qwenvl_inputs(instructions=instructions)
        if FIXED:
            backbone_attention_mask = qwen_inputs.get("attention_mask", None)
            if backbone_attention_mask is not None:
                backbone_attention_mask = backbone_attention_mask.to(dtype=torch.bool)
        qwenvl_outputs = self.qwen_vl_interface(**qwen_inputs, output_hidden_states=True)
        last_hidden = qwenvl_outputs["hidden_states"][-1]
        if FIXED:
            pred_actions = self.action_model.predict_action(
                last_hidden, state, encoder_attention_mask=backbone_attention_mask
            )
        else:
            pred_actions = self.action_model.predict_action(last_hidden, state)
        return {"normalized_actions": pred_actions.numpy()}


model = Qwen_GR00T().eval()
instructions = [[3, 7, 9, 11, 4, 8, 21, 5, 6, 2, 13, 17], [12, 5, 8, 30]]  # second prompt is right-padded
state = torch.randn(2, 1, 4)
init_noise = torch.randn(2, 6, 4)  # the action head's initial flow-matching noise, fixed for comparison
_randn = torch.randn
torch.randn = lambda *a, **k: init_noise.clone()
batched = model.predict_action(instructions, state)["normalized_actions"]
# reference: the short prompt alone (no padding), starting from the same initial noise as its batch row
torch.randn = lambda *a, **k: init_noise[1:].clone()
alone = model.predict_action([instructions[1]], state[1:])["normalized_actions"]
torch.randn = _randn
print(f"max |batched - alone| for padded prompt: {abs(batched[1] - alone[0]).max():.6f}")
