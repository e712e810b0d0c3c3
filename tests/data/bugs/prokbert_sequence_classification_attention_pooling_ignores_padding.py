# ProkBERT (nbrg-ppcu/prokbert PR #109, commit bed3693 "Fixing classification head"): the attention-pooling head of
# ProkBertForSequenceClassification took softmax(weighting_layer(h)) over ALL positions, so PAD positions of a padded
# batch received pooling weight; the fix masks scores with attention_mask (-inf on pads) before the softmax.
import sys
from typing import Optional

import torch
import torch.nn as nn
from transformers import MegatronBertConfig, MegatronBertModel, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ProkBertConfig(MegatronBertConfig):
    model_type = "prokbert"

    def __init__(self, kmer: int = 6, shift: int = 1, num_class_labels: int = 2,
                 classification_dropout_rate: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.kmer = kmer
        self.shift = shift
        self.num_class_labels = num_class_labels
        self.classification_dropout_rate = classification_dropout_rate


class ProkBertPreTrainedModel(PreTrainedModel):
    config_class = ProkBertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()


class ProkBertModel(MegatronBertModel):
    config_class = ProkBertConfig

    def __init__(self, config: ProkBertConfig, **kwargs):
        super().__init__(config, **kwargs)
        self.config = config


class ProkBertForSequenceClassification(ProkBertPreTrainedModel):
    config_class = ProkBertConfig
    base_model_prefix = "bert"

    def __init__(self, config):
        super().__init__(config)
        self.config = config
        self.bert = ProkBertModel(config)
        self.weighting_layer = nn.Linear(self.config.hidden_size, 1)
        self.dropout = nn.Dropout(self.config.classification_dropout_rate)
        self.classifier = nn.Linear(self.config.hidden_size, self.config.num_class_labels)
        self.loss_fct = torch.nn.CrossEntropyLoss()
        self.post_init()

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.FloatTensor] = None,
                labels: Optional[torch.LongTensor] = None):
        outputs = self.bert(input_ids, attention_mask=attention_mask, return_dict=True)
        sequence_output = outputs[0]

        # Compute weights for each position in the sequence
        weights = self.weighting_layer(sequence_output)
        if FIXED:
            # Mask out padding tokens (pooling bug fix)
            keep_mask = attention_mask > 0 if attention_mask is not None else None
            if keep_mask is not None:
                weights = weights.masked_fill(~keep_mask.unsqueeze(-1), float("-inf"))
        weights = torch.nn.functional.softmax(weights, dim=1)
        # Compute weighted sum
        pooled_output = torch.sum(weights * sequence_output, dim=1)
        pooled_output = self.dropout(pooled_output)
        logits = self.classifier(pooled_output)
        loss = None
        if labels is not None:
            loss = self.loss_fct(logits.view(-1, self.config.num_class_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)


config = ProkBertConfig(vocab_size=4101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, initializer_range=0.2,
                        pad_token_id=0, num_class_labels=2)
model = ProkBertForSequenceClassification(config).eval()

# two k-mer tokenized DNA segments: [CLS]=2 ... [SEP]=3, padded with 0 to the longest
long_ids = [2] + torch.randint(5, 4101, (20,)).tolist() + [3]
short_ids = [2] + torch.randint(5, 4101, (9,)).tolist() + [3]
L = len(long_ids)
input_ids = torch.tensor([long_ids, short_ids + [0] * (L - len(short_ids))])
attention_mask = (input_ids != 0).long()
labels = torch.tensor([1, 0])

with torch.no_grad():
    batched = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    alone = model(input_ids=torch.tensor([short_ids]), attention_mask=torch.ones(1, len(short_ids), dtype=torch.long))

diff = (batched.logits[1] - alone.logits[0]).abs().max().item()
print(f"fixed={FIXED} max |logits(short, padded batch) - logits(short, alone)| = {diff:.6f}")
