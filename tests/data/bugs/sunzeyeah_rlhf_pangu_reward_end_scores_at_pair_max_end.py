"""sunzeyeah/RLHF step-2 reward model (PanGu-alpha backbone): pairwise loss and end scores.

Citation: sunzeyeah/RLHF#17 (fixed by commit be87cb5 "update reward.py for reward score calculation"),
src/models/reward.py ``RewardModel.forward``; src/data/data.py ``PairwiseDataset`` (pangu branch);
src/train_reward.py ``compute_metrics``. The PanGu backbone (GPTPanguModel: learned positions, a
top query layer over query-position embeddings, causal bias plus ``(1 - attention_mask) * -10000``)
is written here from the remote code's layout (recalled), at toy sizes with random weights.

The bug: each chosen / rejected sequence is right-padded to max_length on its own; the loss runs
over ``[divergence_ind, end_ind)`` with ``end_ind = max(c_ind, r_ind)`` (the later of the two first
pad positions), and the reported scores were ``c_truncated_reward[-1]`` / ``r_truncated_reward[-1]``,
i.e. the value head at ``end_ind - 1`` for both sequences: for the shorter one of the pair that is
a padding position.

The fix: ``chosen_values[i][c_ind - 1]`` and ``reject_values[i][r_ind - 1]``, each sequence's own
last non-padding token.
"""

import math
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler
from transformers.configuration_utils import PretrainedConfig

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class GPTPanguConfig(PretrainedConfig):
    model_type = "gpt_pangu"

    def __init__(self, vocab_size=40, max_position_embeddings=32, hidden_size=32, intermediate_size=64,
                 num_layers=3, num_heads=4, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, layer_norm_epsilon=1e-5, scale_attn_weights=True, initializer_range=0.02,
                 pad_token_id=6, **kwargs):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.activation_function = activation_function
        self.resid_pdrop = resid_pdrop
        self.embd_pdrop = embd_pdrop
        self.attn_pdrop = attn_pdrop
        self.layer_norm_epsilon = layer_norm_epsilon
        self.scale_attn_weights = scale_attn_weights
        self.initializer_range = initializer_range
        super().__init__(pad_token_id=pad_token_id, **kwargs)


class GPTPanguAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.uint8)).view(
                1, 1, max_positions, max_positions),
        )
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.scale_attn_weights = config.scale_attn_weights
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / (float(value.size(-1)) ** 0.5)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length: key_length, :key_length].bool()
        attn_weights = torch.where(causal_mask, attn_weights, self.masked_bias.to(attn_weights.dtype))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.Softmax(dim=-1)(attn_weights)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)
        if head_mask is not None:
            attn_weights = attn_weights * head_mask
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        tensor = tensor.view(*new_shape)
        return tensor.permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, head_mask=None,
                custom_query=None, use_cache=False, output_attentions=False):
        query = self.q_proj(custom_query) if custom_query is not None else self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)

        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)

        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache is True else None

        attn_output, attn_weights = self._attn(query, key, value, attention_mask, head_mask)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)

        outputs = (attn_output, present)
        if output_attentions:
            outputs += (attn_weights,)
        return outputs


class GPTPanguMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        embed_dim = config.hidden_size
        self.c_fc = nn.Linear(embed_dim, intermediate_size)
        self.c_proj = nn.Linear(intermediate_size, embed_dim)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        return self.dropout(hidden_states)


class GPTPanguBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.intermediate_size if config.intermediate_size is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPTPanguAttention(config)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPTPanguMLP(inner_dim, config)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, head_mask=None,
                custom_query=None, use_cache=False, output_attentions=False):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_outputs = self.attn(hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                                 head_mask=head_mask, custom_query=custom_query, use_cache=use_cache,
                                 output_attentions=output_attentions)
        attn_output = attn_outputs[0]
        outputs = attn_outputs[1:]
        hidden_states = attn_output + residual

        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = residual + feed_forward_hidden_states

        if use_cache:
            outputs = (hidden_states,) + outputs
        else:
            outputs = (hidden_states,) + outputs[1:]
        return outputs


class GPTPanguModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.wqe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPTPanguBlock(config) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(mean=0.0, std=config.initializer_range * 10)

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None,
                position_ids=None, head_mask=None, inputs_embeds=None, use_cache=None):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        batch_size = input_ids.shape[0]
        device = input_ids.device

        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)
        if position_ids is None:
            position_ids = torch.arange(past_length, input_shape[-1] + past_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).view(-1, input_shape[-1])

        # GPTPanguAttentionMask
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = attention_mask.to(dtype=self.wte.weight.dtype)
            attention_mask = (1.0 - attention_mask) * -10000.0

        inputs_embeds = self.wte(input_ids)
        position_embeds = self.wpe(position_ids)
        hidden_states = inputs_embeds + position_embeds
        hidden_states = self.drop(hidden_states)

        output_shape = input_shape + (hidden_states.size(-1),)

        presents = () if use_cache else None
        for i, (block, layer_past) in enumerate(zip(self.h, past_key_values)):
            if i == len(self.h) - 1:
                custom_query = self.wqe(position_ids)
            else:
                custom_query = None
            outputs = block(hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                            head_mask=None, custom_query=custom_query, use_cache=use_cache)
            hidden_states = outputs[0]
            if use_cache is True:
                presents = presents + (outputs[1],)

        hidden_states = self.ln_f(hidden_states)
        hidden_states = hidden_states.view(*output_shape)
        return (hidden_states, presents)


class RewardModel(nn.Module):
    def __init__(self, config, model, tokenizer):
        super().__init__()
        self.config = config
        self.model_type = config.model_type
        self.pad_id = tokenizer.pad_token_id
        self.transformer = model
        self.v_head = nn.Linear(config.hidden_size, 1, bias=False)

    def reward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
        batch_size = input_ids.shape[0]
        transformer_outputs = self.transformer(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                               use_cache=use_cache)
        if self.model_type == "pangu":
            hidden_states = transformer_outputs[0]
            hidden_states = hidden_states.squeeze(1)
        else:
            raise ValueError(f"Unsupported model type: {self.model_type}")

        assert len(hidden_states.shape) == 3

        values = self.v_head(hidden_states).squeeze(-1)
        rewards = None
        return values, rewards

    def forward(self, chosen_input_ids, chosen_attention_mask=None, chosen_position_ids=None,
                rejected_input_ids=None, rejected_attention_mask=None, rejected_position_ids=None,
                use_cache=None):
        bs = chosen_input_ids.shape[0]
        chosen_end_scores = []
        rejected_end_scores = []

        # compute reward for chosen inputs
        chosen_values, chosen_reward = self.reward(chosen_input_ids, attention_mask=chosen_attention_mask,
                                                   position_ids=chosen_position_ids, use_cache=use_cache)
        if len(chosen_input_ids.shape) == 3:
            chosen_input_ids = chosen_input_ids.squeeze(1)

        # compute reward for rejected inputs if it is not none
        if rejected_input_ids is not None:
            reject_values, reject_reward = self.reward(rejected_input_ids, attention_mask=rejected_attention_mask,
                                                       position_ids=rejected_position_ids, use_cache=use_cache)
            if len(rejected_input_ids.shape) == 3:
                rejected_input_ids = rejected_input_ids.squeeze(1)
            loss = 0
            for i in range(bs):
                # Check if there is any padding otherwise take length of sequence
                c_inds = (chosen_input_ids[i] == self.pad_id).nonzero()
                c_ind = c_inds[0].item() if len(c_inds) > 0 else chosen_input_ids.shape[1]
                r_inds = (rejected_input_ids[i] == self.pad_id).nonzero()
                r_ind = r_inds[0].item() if len(r_inds) > 0 else rejected_input_ids.shape[1]
                end_ind = max(c_ind, r_ind)

                # Retrieve first index where trajectories diverge
                divergence_ind = (chosen_input_ids[i] != rejected_input_ids[i]).nonzero()[0]
                assert divergence_ind > 0

                # Index into the correct rewards
                c_truncated_reward = chosen_values[i][divergence_ind:end_ind]
                r_truncated_reward = reject_values[i][divergence_ind:end_ind]

                # Use the last non-padding token output as reward score
                if FIXED:
                    chosen_end_scores.append(chosen_values[i][c_ind - 1])
                    rejected_end_scores.append(reject_values[i][r_ind - 1])
                else:
                    chosen_end_scores.append(c_truncated_reward[-1])
                    rejected_end_scores.append(r_truncated_reward[-1])

                # Compute loss
                loss += -torch.log(torch.sigmoid(c_truncated_reward - r_truncated_reward)).mean()
            loss = loss / bs
            rejected_end_scores = torch.stack(rejected_end_scores)
        else:
            reject_values = None
            rejected_end_scores = None
            loss = None
            for i in range(bs):
                c_inds = (chosen_input_ids[i] == self.pad_id).nonzero()
                c_ind = c_inds[0].item() if len(c_inds) > 0 else chosen_input_ids.shape[1]
                chosen_end_scores.append(chosen_values[i, c_ind - 1])

        chosen_end_scores = torch.stack(chosen_end_scores)

        return {
            "loss": loss,
            "chosen_values": chosen_values,
            "chosen_reward": chosen_end_scores,
            "reject_values": reject_values,
            "reject_reward": rejected_end_scores,
        }


class ToyPanguTokenizer:
    """Stands in for the PanGu (jieba + sentencepiece) tokenizer: one id per character, text pairs
    joined as ``prompt <sep> answer <eot>``, right padding with ``pad_token_id``."""

    pad_token_id = 6
    sep_token_id = 7
    eos_token_id = 9
    padding_side = "right"

    def _ids(self, text):
        return [10 + (ord(ch) % 30) for ch in text]

    def __call__(self, text, text_pair, max_length, truncation="longest_first", padding="max_length",
                 return_tensors="pt", return_token_type_ids=False):
        a, b = self._ids(text), self._ids(text_pair)
        while len(a) + len(b) + 2 > max_length:
            if len(a) >= len(b):
                a = a[:-1]
            else:
                b = b[:-1]
        ids = a + [self.sep_token_id] + b + [self.eos_token_id]
        mask = [1] * len(ids)
        ids = ids + [self.pad_token_id] * (max_length - len(ids))
        mask = mask + [0] * (max_length - len(mask))
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.tensor([mask])}


class Args:
    model_name_or_path = "pangu-350M"
    max_length = 24


class PairwiseDataset(Dataset):
    def __init__(self, args, pairs, tokenizer):
        self.pairs = pairs
        self.args = args
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, idx):
        pair = self.pairs[idx]
        prompt = pair["prompt"]
        chosen_answer = pair["chosen_answer"]
        rejected_answer = pair["rejected_answer"]
        prefix = pair["prefix"]
        if "pangu" in self.args.model_name_or_path:
            chosen_encodings_dict = self.tokenizer(prompt, prefix + chosen_answer, max_length=self.args.max_length,
                                                   truncation="longest_first", padding="max_length",
                                                   return_tensors="pt", return_token_type_ids=False)
            rejected_encodings_dict = self.tokenizer(prompt, prefix + rejected_answer,
                                                     max_length=self.args.max_length, truncation="longest_first",
                                                     padding="max_length", return_tensors="pt",
                                                     return_token_type_ids=False)
            return {
                "chosen_input_ids": chosen_encodings_dict["input_ids"],
                "chosen_attention_mask": chosen_encodings_dict["attention_mask"],
                "rejected_input_ids": rejected_encodings_dict["input_ids"],
                "rejected_attention_mask": rejected_encodings_dict["attention_mask"],
                "labels": rejected_encodings_dict["input_ids"],
            }
        raise ValueError(f"Unsupported model name: {self.args.model_name_or_path}")


def compute_metrics(chosen_end_scores, rejected_end_scores):
    result = {}
    acc = sum(chosen_end_scores > rejected_end_scores) / len(rejected_end_scores)
    result["accuracy"] = float(acc)
    return result


def main():
    args = Args()
    tokenizer = ToyPanguTokenizer()
    config = GPTPanguConfig(pad_token_id=tokenizer.pad_token_id)
    config.model_type = "pangu"
    backbone = GPTPanguModel(config)
    reward_model = RewardModel(config, backbone, tokenizer)
    reward_model.eval()
    assert config.pad_token_id == tokenizer.pad_token_id

    pairs = [
        {"prompt": "how far", "prefix": "A:", "chosen_answer": "about two miles", "rejected_answer": "no"},
        {"prompt": "best tea", "prefix": "A:", "chosen_answer": "green", "rejected_answer": "i do not know at all"},
        {"prompt": "why sky", "prefix": "A:", "chosen_answer": "light scatters", "rejected_answer": "blue dye"},
        {"prompt": "say hi", "prefix": "A:", "chosen_answer": "hello", "rejected_answer": "bye"},
    ]
    dataset = PairwiseDataset(args, pairs, tokenizer)
    loader = DataLoader(dataset, batch_size=4, sampler=SequentialSampler(dataset))

    chosen_all, rejected_all = [], []
    with torch.no_grad():
        for batch in loader:
            batch.pop("labels")
            out = reward_model(**batch)
            print(f"loss={out['loss'].item():.6f}")
            chosen_all.append(out["chosen_reward"])
            rejected_all.append(out["reject_reward"])
    chosen = torch.cat(chosen_all)
    rejected = torch.cat(rejected_all)
    print("chosen_end_scores  ", [round(v, 4) for v in chosen.tolist()])
    print("rejected_end_scores", [round(v, 4) for v in rejected.tolist()])
    print("eval", compute_metrics(chosen.numpy(), rejected.numpy()))


if __name__ == "__main__":
    main()
