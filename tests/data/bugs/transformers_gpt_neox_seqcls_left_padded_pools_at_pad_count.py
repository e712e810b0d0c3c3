# huggingface/transformers#24979 ("[`ForSequenceClassification`] Support `left` padding", addresses #24265),
# GPTNeoXForSequenceClassification.forward (src/transformers/models/gpt_neox/modeling_gpt_neox.py, v4.31 -> v4.32).
# Bug: the token whose logits are pooled is found as `torch.ne(input_ids, pad_token_id).sum(-1) - 1`, i.e. the count
# of real tokens minus one, which is the last real token only when the batch is right-padded; on a left-padded batch
# a padded row is scored at a token in the middle of its text.
# Fix: `torch.eq(input_ids, pad_token_id).long().argmax(-1) - 1` (the position before the first pad; -1, the last
# position, for a row that starts with padding or has none).
# Here: a Pythia-style reward model (GPT-NeoX, <|padding|> = 1, <|endoftext|> = 0) scores a batch of
# prompt + response texts that the tokenizer padded on the left, with a regression loss against target rewards.
import sys

import torch
import torch.nn as nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import GPTNeoXConfig, GPTNeoXModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class GPTNeoXForSequenceClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.gpt_neox = GPTNeoXModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
    ):
        outputs = self.gpt_neox(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden_states = outputs[0]
        logits = self.score(hidden_states)

        if input_ids is not None:
            batch_size, sequence_length = input_ids.shape[:2]
        else:
            batch_size, sequence_length = inputs_embeds.shape[:2]

        if self.config.pad_token_id is None and batch_size != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        if self.config.pad_token_id is None:
            sequence_lengths = -1
        else:
            if input_ids is not None:
                if FIXED:
                    sequence_lengths = (torch.eq(input_ids, self.config.pad_token_id).long().argmax(-1) - 1).to(
                        logits.device
                    )
                else:
                    sequence_lengths = (torch.ne(input_ids, self.config.pad_token_id).sum(-1) - 1).to(logits.device)
            else:
                sequence_lengths = -1

        pooled_logits = logits[torch.arange(batch_size, device=logits.device), sequence_lengths]

        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif self.num_labels > 1 and (labels.dtype == torch.long or labels.dtype == torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"

            if self.config.problem_type == "regression":
                loss_fct = MSELoss()
                if self.num_labels == 1:
                    loss = loss_fct(pooled_logits.squeeze(), labels.squeeze())
                else:
                    loss = loss_fct(pooled_logits, labels)
            elif self.config.problem_type == "single_label_classification":
                loss_fct = CrossEntropyLoss()
                loss = loss_fct(pooled_logits.view(-1, self.num_labels), labels.view(-1))
            elif self.config.problem_type == "multi_label_classification":
                loss_fct = BCEWithLogitsLoss()
                loss = loss_fct(pooled_logits, labels)
        return loss, pooled_logits


def pad_left(seqs, pad_id):
    # tokenizer.padding_side = "left"; tokenizer(texts, padding=True)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, width - len(s):] = torch.tensor(s)
        attention_mask[i, width - len(s):] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def main():
    config = GPTNeoXConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        rotary_pct=0.25,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        num_labels=1,
    )
    config._attn_implementation = "eager"
    model = GPTNeoXForSequenceClassification(config).eval()

    EOS = config.eos_token_id
    g = torch.Generator().manual_seed(1)
    lengths = [14, 9, 6]
    texts = [torch.randint(2, config.vocab_size, (n,), generator=g).tolist() + [EOS] for n in lengths]
    batch = pad_left(texts, config.pad_token_id)
    target_rewards = torch.tensor([1.0, -0.5, 0.25])

    with torch.no_grad():
        loss, rewards = model(**batch, labels=target_rewards)
    print("input_ids:\n", batch["input_ids"])
    print("rewards:", [round(r, 4) for r in rewards.squeeze(-1).tolist()])
    print("mse loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
