# Citation: huggingface/transformers src/transformers/models/decision_transformer/modeling_decision_transformer.py
#   (DecisionTransformerModel.forward: stacked_attention_mask = stack((m, m, m), dim=1).permute(0, 2, 1).reshape(B, 3*T))
#   and the get_action loop of the HF Decision Transformer blog / examples/research_projects/decision_transformer.
# Masking: returns, states and actions are interleaved (R_t, s_t, a_t) into 3T GPT-2 tokens; the per-timestep 0/1
#   attention mask is repeated for each of the three tokens; histories are LEFT-padded to the context window, so
#   the GPT-2 causal mask plus the key padding mask keeps only real earlier tokens (the action is read off s_t).
import torch
from transformers import DecisionTransformerConfig, DecisionTransformerModel

torch.manual_seed(0)
state_dim, act_dim, K = 5, 3, 6
config = DecisionTransformerConfig(state_dim=state_dim, act_dim=act_dim, hidden_size=32, n_layer=2, n_head=4,
                                   max_ep_len=100, n_positions=64)
model = DecisionTransformerModel(config).eval()


def get_action(model, states, actions, rewards, returns_to_go, timesteps):
    states = states.reshape(1, -1, model.config.state_dim)
    actions = actions.reshape(1, -1, model.config.act_dim)
    returns_to_go = returns_to_go.reshape(1, -1, 1)
    timesteps = timesteps.reshape(1, -1)
    states = states[:, -K:]
    actions = actions[:, -K:]
    returns_to_go = returns_to_go[:, -K:]
    timesteps = timesteps[:, -K:]
    padding = K - states.shape[1]
    attention_mask = torch.cat([torch.zeros(padding), torch.ones(states.shape[1])])
    attention_mask = attention_mask.to(dtype=torch.long).reshape(1, -1)
    states = torch.cat([torch.zeros((1, padding, model.config.state_dim)), states], dim=1).float()
    actions = torch.cat([torch.zeros((1, padding, model.config.act_dim)), actions], dim=1).float()
    returns_to_go = torch.cat([torch.zeros((1, padding, 1)), returns_to_go], dim=1).float()
    timesteps = torch.cat([torch.zeros((1, padding), dtype=torch.long), timesteps], dim=1)
    state_preds, action_preds, return_preds = model(states=states, actions=actions, rewards=rewards,
                                                    returns_to_go=returns_to_go, timesteps=timesteps,
                                                    attention_mask=attention_mask, return_dict=False)
    return action_preds[0, -1]


target_return = torch.tensor(10.0).reshape(1, 1)
states = torch.randn(1, state_dim)
actions = torch.zeros((0, act_dim))
rewards = torch.zeros(0)
timesteps = torch.tensor(0).reshape(1, 1)
with torch.no_grad():
    for t in range(9):
        actions = torch.cat([actions, torch.zeros((1, act_dim))], dim=0)
        rewards = torch.cat([rewards, torch.zeros(1)])
        action = get_action(model, states, actions, rewards, target_return, timesteps)
        actions[-1] = action
        reward = float(action.sum())
        states = torch.cat([states, torch.randn(1, state_dim)], dim=0)
        rewards[-1] = reward
        target_return = torch.cat([target_return, (target_return[0, -1] - reward).reshape(1, 1)], dim=1)
        timesteps = torch.cat([timesteps, torch.ones((1, 1), dtype=torch.long) * (t + 1)], dim=1)
print(f"actions norm {actions.norm().item():.4f}")
