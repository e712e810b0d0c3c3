# ColossalAI Chat / coati (hpcaitech/ColossalAI#4471, fixing #4125): RewardModel.forward averaged the value head over
# every position `[:, :-1]` of the max_length-padded batch, ignoring attention_mask, so pad positions enter the reward;
# the fix reads the value at the last real token, found from attention_mask.
import sys
from typing import Optional

import torch
import torch.nn as nn
from transformers.models.gpt2.configuration_gpt2 import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LoRAModule(nn.Module):
    def __init__(self, lora_rank: int = 0, lora_train_bias: str = "none") -> None:
        super().__init__()
        self.lora_rank = lora_rank
        self.lora_train_bias = lora_train_bias

    def convert_to_lora(self) -> None:
        if self.lora_rank <= 0:
            return


class RewardModel(LoRAModule):
    def __init__(self, model: nn.Module, value_head: Optional[nn.Module] = None, lora_rank: int = 0,
                 lora_train_bias: str = "none") -> None:
        super().__init__(lora_rank=lora_rank, lora_train_bias=lora_train_bias)
        self.model = model
        self.convert_to_lora()

        if value_head is not None:
            if value_head.out_features != 1:
                raise ValueError("The value head of reward model's output dim should be 1!")
            self.value_head = value_head
        else:
            self.value_head = nn.Linear(model.config.n_embd, 1)

    def forward(self, sequences: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        outputs = self.model(sequences, attention_mask=attention_mask)
        last_hidden_states = outputs["last_hidden_state"]
        if FIXED:
            sequence_lengths = torch.max(attention_mask * torch.arange(sequences.size(1), device=sequences.device),
                                         dim=1)[0]
            sequence_hidden_states = last_hidden_states[torch.arange(last_hidden_states.size(0)), sequence_lengths]
            values = self.value_head(sequence_hidden_states).squeeze(1)  # ensure shape is (B, )
            return values
        values = self.value_head(last_hidden_states)[:, :-1]
        value = values.mean(dim=1).squeeze(1)  # ensure shape is (B)
        return value


class GPTRM(RewardModel):
    def __init__(self, pretrained=None, config: Optional[GPT2Config] = None, lora_rank: int = 0,
                 lora_train_bias: str = "none") -> None:
        model = GPT2Model(config)
        value_head = nn.Linear(model.config.n_embd, 1)
        value_head.weight.data.normal_(mean=0.0, std=1 / (model.config.n_embd + 1))
        super().__init__(model, value_head, lora_rank, lora_train_bias)


class LogSigLoss(nn.Module):
    def forward(self, chosen_reward: torch.Tensor, reject_reward: torch.Tensor) -> torch.Tensor:
        probs = torch.sigmoid(chosen_reward - reject_reward)
        log_probs = torch.log(probs)
        loss = -log_probs.mean()
        return loss


EOS = 0  # gpt2-style tokenizer: pad_token = eos_token


def tokenize_max_length(seqs, max_length):
    # tokenizer(..., max_length=max_length, padding="max_length", truncation=True): right padding
    ids = torch.full((len(seqs), max_length), EOS, dtype=torch.long)
    mask = torch.zeros((len(seqs), max_length), dtype=torch.long)
    for i, s in enumerate(seqs):
        s = s[:max_length]
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


class RmStaticDataset(torch.utils.data.Dataset):
    def __init__(self, dataset, max_length: int) -> None:
        chosen = [d["prompt"] + d["chosen"] + [EOS] for d in dataset]
        c_ids, c_mask = tokenize_max_length(chosen, max_length)
        self.chosen = {"input_ids": c_ids, "attention_mask": c_mask}
        reject = [d["prompt"] + d["rejected"] + [EOS] for d in dataset]
        r_ids, r_mask = tokenize_max_length(reject, max_length)
        self.reject = {"input_ids": r_ids, "attention_mask": r_mask}

    def __len__(self):
        return self.chosen["input_ids"].shape[0]

    def __getitem__(self, idx):
        return (self.chosen["input_ids"][idx], self.chosen["attention_mask"][idx],
                self.reject["input_ids"][idx], self.reject["attention_mask"][idx])


config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, initializer_range=0.2, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
config._attn_implementation = "eager"
model = GPTRM(config=config).eval()
loss_fn = LogSigLoss()

raw = [
    {"prompt": [5, 9, 13], "chosen": [21, 22, 23, 24], "rejected": [30, 31]},
    {"prompt": [7, 8], "chosen": [40, 41, 42], "rejected": [44, 45, 46, 47, 48, 49]},
    {"prompt": [11, 12, 13, 14], "chosen": [50], "rejected": [52, 53, 54]},
]
dataset = RmStaticDataset(raw, max_length=16)
loader = torch.utils.data.DataLoader(dataset, batch_size=3)

# RewardModelTrainer step (eval-style: no grad needed for the number)
for chosen_ids, c_mask, reject_ids, r_mask in loader:
    with torch.no_grad():
        chosen_reward = model(chosen_ids, attention_mask=c_mask)
        reject_reward = model(reject_ids, attention_mask=r_mask)
        loss = loss_fn(chosen_reward, reject_reward)

# reference: each sequence scored alone, no padding
max_diff = 0.0
for d, cr, rr in zip(raw, chosen_reward, reject_reward):
    for seq, batched in ((d["prompt"] + d["chosen"] + [EOS], cr), (d["prompt"] + d["rejected"] + [EOS], rr)):
        ids = torch.tensor([seq])
        with torch.no_grad():
            alone = model(ids, attention_mask=torch.ones_like(ids))
        max_diff = max(max_diff, (batched - alone[0]).abs().item())
print(f"loss = {loss.item():.6f}")
print(f"max |reward(max_length padded batch) - reward(sequence alone)| = {max_diff:.6f}")
