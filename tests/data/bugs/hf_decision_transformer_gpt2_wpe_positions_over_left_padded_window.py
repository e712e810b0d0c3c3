# huggingface/transformers#17946 ("Decision Transformer Position Embedding Incorrect Implementation", closed as fixed).
#
# DecisionTransformerModel says its GPT-2 backbone has "the positional embeddings removed (since we'll add those
# ourselves)": the timestep embedding is the only position signal.  But DecisionTransformerModel.forward called
# self.encoder(inputs_embeds=stacked_inputs, attention_mask=stacked_attention_mask, ...) without position_ids, so
# DecisionTransformerGPT2Model built arange(3 * K) and added wpe(position_ids) to every (R, s, a) token.  In the
# huggingface/blog get_action loop the context window is LEFT-padded to K steps, so the slot index of a real token
# (and with it the wpe row it gets) depends on how much padding sits in front of it.
# The fix passes position_ids=torch.zeros(stacked_attention_mask.shape) to the encoder, so every token gets the same
# wpe row (as kzl/decision-transformer's trajectory_gpt2.py, which drops wpe altogether).
#
# `python FILE` runs forward as it was before the fix; `python FILE --fixed` as it is after.
import sys

import torch
from transformers import DecisionTransformerConfig, DecisionTransformerModel

FIXED = "--fixed" in sys.argv


class DecisionTransformerModelPort(DecisionTransformerModel):
    """transformers' DecisionTransformerModel.forward, trimmed to the tensors it returns."""

    def forward(self, states=None, actions=None, rewards=None, returns_to_go=None, timesteps=None,
                attention_mask=None, return_dict=None):
        batch_size, seq_length = states.shape[0], states.shape[1]

        if attention_mask is None:
            # attention mask for GPT: 1 if can be attended to, 0 if not
            attention_mask = torch.ones((batch_size, seq_length), dtype=torch.long)

        # embed each modality with a different head
        state_embeddings = self.embed_state(states)
        action_embeddings = self.embed_action(actions)
        returns_embeddings = self.embed_return(returns_to_go)
        time_embeddings = self.embed_timestep(timesteps)

        # time embeddings are treated similar to positional embeddings
        state_embeddings = state_embeddings + time_embeddings
        action_embeddings = action_embeddings + time_embeddings
        returns_embeddings = returns_embeddings + time_embeddings

        # this makes the sequence look like (R_1, s_1, a_1, R_2, s_2, a_2, ...)
        stacked_inputs = (
            torch.stack((returns_embeddings, state_embeddings, action_embeddings), dim=1)
            .permute(0, 2, 1, 3)
            .reshape(batch_size, 3 * seq_length, self.hidden_size)
        )
        stacked_inputs = self.embed_ln(stacked_inputs)

        # to make the attention mask fit the stacked inputs, have to stack it as well
        stacked_attention_mask = (
            torch.stack((attention_mask, attention_mask, attention_mask), dim=1)
            .permute(0, 2, 1)
            .reshape(batch_size, 3 * seq_length)
        )
        device = stacked_inputs.device
        # we feed in the input embeddings (not word indices as in NLP) to the model
        if FIXED:
            encoder_outputs = self.encoder(
                inputs_embeds=stacked_inputs,
                attention_mask=stacked_attention_mask,
                position_ids=torch.zeros(stacked_attention_mask.shape, device=device, dtype=torch.long),
                return_dict=True,
            )
        else:
            encoder_outputs = self.encoder(
                inputs_embeds=stacked_inputs,
                attention_mask=stacked_attention_mask,
                return_dict=True,
            )
        x = encoder_outputs[0]

        # reshape x so that the second dimension corresponds to the original
        # returns (0), states (1), or actions (2); i.e. x[:,1,t] is the token for s_t
        x = x.reshape(batch_size, seq_length, 3, self.hidden_size).permute(0, 2, 1, 3)

        return_preds = self.predict_return(x[:, 2])
        state_preds = self.predict_state(x[:, 2])
        action_preds = self.predict_action(x[:, 1])
        return state_preds, action_preds, return_preds


# huggingface/blog train-decision-transformers: get_action, the window padded at the start to model.config.max_length
def get_action(model, states, actions, rewards, returns_to_go, timesteps):
    states = states.reshape(1, -1, model.config.state_dim)
    actions = actions.reshape(1, -1, model.config.act_dim)
    returns_to_go = returns_to_go.reshape(1, -1, 1)
    timesteps = timesteps.reshape(1, -1)

    states = states[:, -model.config.max_length:]
    actions = actions[:, -model.config.max_length:]
    returns_to_go = returns_to_go[:, -model.config.max_length:]
    timesteps = timesteps[:, -model.config.max_length:]
    padding = model.config.max_length - states.shape[1]
    # pad all tokens to sequence length
    attention_mask = torch.cat([torch.zeros(padding), torch.ones(states.shape[1])])
    attention_mask = attention_mask.to(dtype=torch.long).reshape(1, -1)
    states = torch.cat([torch.zeros((1, padding, model.config.state_dim)), states], dim=1).float()
    actions = torch.cat([torch.zeros((1, padding, model.config.act_dim)), actions], dim=1).float()
    returns_to_go = torch.cat([torch.zeros((1, padding, 1)), returns_to_go], dim=1).float()
    timesteps = torch.cat([torch.zeros((1, padding), dtype=torch.long), timesteps], dim=1)

    state_preds, action_preds, return_preds = model(
        states=states,
        actions=actions,
        rewards=rewards,
        returns_to_go=returns_to_go,
        timesteps=timesteps,
        attention_mask=attention_mask,
        return_dict=False,
    )
    return action_preds[0, -1]


def main():
    torch.manual_seed(0)
    config = DecisionTransformerConfig(
        state_dim=11, act_dim=3, hidden_size=32, max_ep_len=100, n_layer=2, n_head=2, n_inner=64,
        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, action_tanh=True,
        bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )
    config.max_length = 8  # the context length K of the blog's config
    model = DecisionTransformerModelPort(config).eval()
    with torch.no_grad():
        model.encoder.wpe.weight.normal_(0.0, 0.5)  # a trained table is far from zero

    # an episode rolled out for a few steps (the blog's evaluation loop, with a fixed stand-in environment)
    gen = torch.Generator().manual_seed(1)
    target_return = 3.6
    states = torch.randn(1, config.state_dim, generator=gen)
    actions = torch.zeros((0, config.act_dim))
    rewards = torch.zeros(0)
    returns = torch.tensor([[target_return]])
    timesteps = torch.tensor([[0]], dtype=torch.long)
    taken = []
    with torch.no_grad():
        for t in range(5):
            actions = torch.cat([actions, torch.zeros((1, config.act_dim))], dim=0)
            rewards = torch.cat([rewards, torch.zeros(1)])
            action = get_action(model, states, actions, rewards, returns, timesteps)
            actions[-1] = action
            taken.append(action)
            state = torch.tanh(states[-1] + 0.1 * torch.randn(config.state_dim, generator=gen))
            reward = float(action.sum())
            states = torch.cat([states, state.reshape(1, -1)], dim=0)
            returns = torch.cat([returns, (returns[0, -1] - reward).reshape(1, 1)], dim=1)
            timesteps = torch.cat([timesteps, torch.ones((1, 1), dtype=torch.long) * (t + 1)], dim=1)
    for t, a in enumerate(taken):
        print(f"step {t}: action {[round(v, 4) for v in a.tolist()]}")


if __name__ == "__main__":
    main()
