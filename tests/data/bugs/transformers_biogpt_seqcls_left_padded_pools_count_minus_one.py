# huggingface/transformers#46782 ("Fix left-padding token selection in `BioGptForSequenceClassification`").
#
# BioGptForSequenceClassification (src/transformers/models/biogpt/modeling_biogpt.py) scores every position and
# pools the logits of one token per row. Before the fix it found that token as
#     sequence_length = (torch.ne(input_ids, self.config.pad_token_id).sum(-1) - 1)
# i.e. the number of real tokens minus one, which is the last real token only for right padding. #35911 had moved
# the other decoder heads (gpt2, llama, ...) to the rightmost non-pad index; biogpt was missed. The fix uses the same
# block as gpt2: `(token_indices * non_pad_mask).argmax(-1)`.
#
# Here: a batch of two texts, tokenized with padding_side="left" (as for batched decoder use), a labelled
# classification step through a tiny BioGPT built from BioGptConfig. `python FILE` runs the head as it was before
# the fix, `python FILE --fixed` as after.
import sys

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import BioGptConfig, BioGptModel
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.models.biogpt.modeling_biogpt import BioGptPreTrainedModel

FIXED = "--fixed" in sys.argv


class BioGptForSequenceClassification(BioGptPreTrainedModel):
    def __init__(self, config: BioGptConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.biogpt = BioGptModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)

        # Initialize weights and apply final processing
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        position_ids=None,
    ):
        transformer_outputs = self.biogpt(
            input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            position_ids=position_ids,
        )
        hidden_states = transformer_outputs[0]
        logits = self.score(hidden_states)

        if input_ids is not None:
            batch_size, sequence_length = input_ids.shape[:2]
        else:
            batch_size, sequence_length = inputs_embeds.shape[:2]

        if FIXED:
            if self.config.pad_token_id is None and batch_size != 1:
                raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
            if self.config.pad_token_id is None:
                last_non_pad_token = -1
            elif input_ids is not None:
                # To handle both left- and right- padding, we take the rightmost token that is not equal to pad_token_id
                non_pad_mask = (input_ids != self.config.pad_token_id).to(logits.device, torch.int32)
                token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
                last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
            else:
                last_non_pad_token = -1
            pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_non_pad_token]
        else:
            if self.config.pad_token_id is None:
                sequence_length = -1
            else:
                if input_ids is not None:
                    sequence_length = (torch.ne(input_ids, self.config.pad_token_id).sum(-1) - 1).to(logits.device)
                else:
                    sequence_length = -1
            pooled_logits = logits[torch.arange(batch_size, device=logits.device), sequence_length]

        loss = None
        if labels is not None:
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

        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=pooled_logits,
            hidden_states=transformer_outputs.hidden_states,
        )


def left_pad(batch, pad_token_id):
    # tokenizer.pad(..., padding_side="left")
    max_len = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, ids in enumerate(batch):
        input_ids[i, max_len - len(ids):] = torch.tensor(ids)
        attention_mask[i, max_len - len(ids):] = 1
    return input_ids, attention_mask


def main():
    torch.manual_seed(0)
    config = BioGptConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
    )
    model = BioGptForSequenceClassification(config).eval()

    # BioGPT's tokenizer puts </s> (id 2) in front of each text.
    texts = [
        [2, 17, 23, 9, 41, 5, 30, 12],
        [2, 44, 8, 19],
    ]
    input_ids, attention_mask = left_pad(texts, config.pad_token_id)
    labels = torch.tensor([2, 0])

    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    print("input_ids:\n", input_ids)
    print("pooled logits:\n", out.logits)
    print("predictions:", out.logits.argmax(-1).tolist())
    print("loss: %.6f" % out.loss.item())


if __name__ == "__main__":
    main()
