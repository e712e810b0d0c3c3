# facebookresearch/mmf#622 (commit d8f9592b, "[fix] Change format of concatenating image and text as bert input in
# MMBT"). MMBTBase took the image segment's end token as `input_ids[:, -1]`, but bert_processor pads the text as
# `[CLS] tokens [SEP] [PAD] ...`, so for every padded caption the image's `<sep>` is a [PAD] token that
# MMBTModel marks as attendable (the modal segment's mask is all ones). The fix gathers the last position the
# input_mask keeps (the real [SEP]), drops the text's leading [CLS] and shifts input_mask left, appending a 0.
# Ported from mmf/models/mmbt.py (MMBTConfig, ModalEmbeddings, MMBTModel, MMBTBase, MMBTForClassification) with a
# tiny BERT built from its config and direct image features (MMBT's `image_feature_0` path) in place of ResNet-152.
import sys
from typing import Dict, Optional

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertModel
from transformers.models.bert.modeling_bert import BertPredictionHeadTransform

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MMBTConfig:
    def __init__(self, config, num_labels=None, modal_hidden_size=2048):
        self.__dict__ = config.__dict__
        self.modal_hidden_size = modal_hidden_size
        if num_labels:
            self.num_labels = num_labels


class ModalEmbeddings(nn.Module):
    """Generic Modal Embeddings which takes in an encoder, and a transformer embedding."""

    def __init__(self, config, encoder, embeddings):
        super().__init__()
        self.config = config
        self.encoder = encoder
        self.proj_embeddings = nn.Linear(config.modal_hidden_size, config.hidden_size)
        self.position_embeddings = embeddings.position_embeddings
        self.token_type_embeddings = embeddings.token_type_embeddings
        self.word_embeddings = embeddings.word_embeddings
        self.LayerNorm = embeddings.LayerNorm
        self.dropout = nn.Dropout(p=config.hidden_dropout_prob)

    def forward(self, input_modal, start_token=None, end_token=None, position_ids=None, token_type_ids=None):
        token_embeddings = self.proj_embeddings(self.encoder(input_modal))
        seq_length = token_embeddings.size(1)

        if start_token is not None:
            start_token_embeds = self.word_embeddings(start_token)
            seq_length += 1
            token_embeddings = torch.cat([start_token_embeds.unsqueeze(1), token_embeddings], dim=1)

        if end_token is not None:
            end_token_embeds = self.word_embeddings(end_token)
            seq_length += 1
            token_embeddings = torch.cat([token_embeddings, end_token_embeds.unsqueeze(1)], dim=1)

        if position_ids is None:
            position_ids = torch.arange(seq_length, dtype=torch.long, device=input_modal.device)
            position_ids = position_ids.unsqueeze(0).expand(input_modal.size(0), seq_length)

        if token_type_ids is None:
            token_type_ids = torch.zeros(
                (input_modal.size(0), seq_length), dtype=torch.long, device=input_modal.device
            )

        position_embeddings = self.position_embeddings(position_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = token_embeddings + position_embeddings + token_type_embeddings
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class MMBTModel(nn.Module):
    def __init__(self, config, transformer, encoder):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.num_hidden_layers = config.num_hidden_layers
        self.transformer = transformer
        self.modal_encoder = ModalEmbeddings(config, encoder, transformer.embeddings)

    def forward(
        self,
        input_modal: Tensor,
        input_ids: Tensor,
        modal_start_tokens: Optional[Tensor] = None,
        modal_end_tokens: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
        modal_token_type_ids: Optional[Tensor] = None,
        position_ids: Optional[Tensor] = None,
        modal_position_ids: Optional[Tensor] = None,
    ):
        input_txt_shape = input_ids.size()
        device = input_ids.device

        modal_embeddings = self.modal_encoder(
            input_modal,
            start_token=modal_start_tokens,
            end_token=modal_end_tokens,
            position_ids=modal_position_ids,
            token_type_ids=modal_token_type_ids,
        )

        input_modal_shape = modal_embeddings.size()[:-1]

        if token_type_ids is None:
            token_type_ids = torch.ones(input_txt_shape, dtype=torch.long, device=device)

        txt_embeddings = self.transformer.embeddings(
            input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids
        )

        embedding_output = torch.cat([modal_embeddings, txt_embeddings], 1)

        input_shape = embedding_output.size()[:-1]

        if attention_mask is None:
            attention_mask = torch.ones(input_shape, device=device)
        else:
            attention_mask = torch.cat(
                [torch.ones(input_modal_shape, device=device, dtype=torch.long), attention_mask], dim=1
            )

        if attention_mask.dim() == 2:
            attention_mask = attention_mask[:, None, None, :]

        attention_mask = attention_mask.to(dtype=next(self.parameters()).dtype)  # fp16 compatibility
        attention_mask = (1.0 - attention_mask) * -10000.0

        encoder_outputs = self.transformer.encoder(embedding_output, attention_mask=attention_mask)

        sequence_output = encoder_outputs[0]
        pooled_output = self.transformer.pooler(sequence_output)
        return sequence_output, pooled_output


class MMBTBase(nn.Module):
    def __init__(self, config, text_encoder, modal_encoder):
        super().__init__()
        self.config = config
        self._encoder_config = text_encoder.config
        self._mmbt_config = MMBTConfig(
            self._encoder_config, num_labels=config["num_labels"], modal_hidden_size=config["modal_hidden_size"]
        )
        self.use_modal_start_token = config["use_modal_start_token"]
        self.use_modal_end_token = config["use_modal_end_token"]
        self.num_max_segment = 2
        self.mmbt = MMBTModel(self._mmbt_config, text_encoder, modal_encoder)

    def extract_modal_end_token(self, sample_list: Dict[str, Tensor]):
        # compute the position of the last non-masked token, which is <sep>
        gather_index = sample_list["input_mask"].sum(1, keepdim=True) - 1
        modal_end_token = torch.gather(sample_list["input_ids"], 1, gather_index).squeeze(1).clone().detach()

        batch_size = sample_list["input_ids"].size(0)
        device = sample_list["input_ids"].device
        # remove start_token in input_ids
        sample_list["input_ids"] = torch.cat(
            [sample_list["input_ids"][:, 1:], sample_list["input_ids"][:, -1:]], dim=1
        )
        # update input_mask
        sample_list["input_mask"] = torch.cat(
            [sample_list["input_mask"][:, 1:], torch.zeros([batch_size, 1], dtype=torch.long, device=device)],
            dim=1,
        )
        return modal_end_token

    def forward(self, sample_list: Dict[str, Tensor]):
        input_modal = sample_list["image_feature_0"]

        modal_start_token: Optional[Tensor] = None
        if self.use_modal_start_token:
            modal_start_token = sample_list["input_ids"][:, 0].clone().detach()

        modal_end_token: Optional[Tensor] = None
        if self.use_modal_end_token:
            if FIXED:
                modal_end_token = self.extract_modal_end_token(sample_list)
            else:
                modal_end_token = sample_list["input_ids"][:, -1].clone().detach()

        segment_ids = sample_list["segment_ids"]
        token_value = 0
        max_id = segment_ids.max()
        min_id = segment_ids.min()
        if max_id == min_id:
            if max_id == torch.tensor(0, dtype=max_id.dtype):
                token_value = 1
        modal_token_type_ids = torch.full(
            (input_modal.size(0), 1), fill_value=token_value, dtype=torch.long, device=input_modal.device
        )

        return self.mmbt(
            input_modal,
            input_ids=sample_list["input_ids"],
            modal_start_tokens=modal_start_token,
            modal_end_tokens=modal_end_token,
            attention_mask=sample_list["input_mask"],
            token_type_ids=sample_list["segment_ids"],
            modal_token_type_ids=modal_token_type_ids,
            position_ids=None,
            modal_position_ids=None,
        )


class MMBTForClassification(nn.Module):
    def __init__(self, config, text_encoder, modal_encoder):
        super().__init__()
        self.config = config
        self.bert = MMBTBase(config, text_encoder, modal_encoder)
        self.encoder_config = self.bert._encoder_config
        self.num_labels = config["num_labels"]
        self.dropout = nn.Dropout(self.encoder_config.hidden_dropout_prob)
        self.classifier = nn.Sequential(
            BertPredictionHeadTransform(self.encoder_config),
            nn.Linear(self.encoder_config.hidden_size, self.num_labels),
        )

    def forward(self, sample_list: Dict[str, Tensor]):
        module_output = self.bert(sample_list)
        pooled_output = self.dropout(module_output[1])
        logits = self.classifier(pooled_output)
        return {"scores": logits.contiguous().view(-1, self.num_labels)}


# bert_processor: "[CLS] tokens [SEP]" padded with [PAD] to max_seq_length, input_mask 1 on real tokens.
CLS, SEP, PAD = 101, 102, 0
MAX_SEQ_LENGTH = 12


def bert_processor(token_ids):
    ids = [CLS] + token_ids + [SEP]
    mask = [1] * len(ids)
    ids = ids + [PAD] * (MAX_SEQ_LENGTH - len(ids))
    mask = mask + [0] * (MAX_SEQ_LENGTH - len(mask))
    return ids, mask


bert_config = BertConfig(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=32, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)
text_encoder = BertModel(bert_config).eval()
modal_encoder = nn.Identity()  # direct image features (image_feature_0)
mmbt_config = {
    "num_labels": 2, "modal_hidden_size": 24, "use_modal_start_token": True, "use_modal_end_token": True,
}
model = MMBTForClassification(mmbt_config, text_encoder, modal_encoder).eval()

captions = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23], [31, 32, 33, 34, 35]]
processed = [bert_processor(c) for c in captions]
sample_list = {
    "input_ids": torch.tensor([p[0] for p in processed]),
    "input_mask": torch.tensor([p[1] for p in processed]),
    "segment_ids": torch.zeros(len(captions), MAX_SEQ_LENGTH, dtype=torch.long),
    "image_feature_0": torch.randn(len(captions), 4, 24),
}

with torch.no_grad():
    scores = model(sample_list)["scores"]
probs = scores.softmax(-1)
for i, p in enumerate(probs):
    print(f"sample {i}: caption length {len(captions[i])}, class probabilities {p.tolist()}")
print("predictions:", probs.argmax(-1).tolist())
