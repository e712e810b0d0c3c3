"""sentence-transformers + PEFT prompt tuning: token embeddings trimmed with the un-extended attention mask.

Citation: huggingface/sentence-transformers#3000 (commit 1912788f, "[peft] If AutoModel is wrapped with PEFT for
prompt learning, then extend the attention mask").

A SentenceTransformer whose Transformer module's auto_model is a PeftModelForFeatureExtraction with prompt tuning:
PEFT prepends `num_virtual_tokens` learned embeddings to inputs_embeds and extends the attention mask it hands the
base model, so `token_embeddings` come back (batch, num_virtual_tokens + seq_len, hidden). Before the fix,
Transformer.forward put those token embeddings in `features` next to the tokenizer's own attention_mask (seq_len
wide), and encode(output_value="token_embeddings") trims each row's padding by walking that mask, so each row is
cut at the wrong place (virtual tokens kept, the last real tokens dropped, pad positions kept). The fix prepends
ones(batch, num_virtual_tokens) to features["attention_mask"] in Transformer.forward when the model is a
prompt-learning PeftModelForFeatureExtraction.

Ported from sentence_transformers/models/Transformer.py, models/Pooling.py (cls) and SentenceTransformer.encode at
1912788f^ / 1912788f, and peft/peft_model.py PeftModelForFeatureExtraction.forward + PromptEmbedding (prompt tuning,
random init). The BERT encoder is built from a tiny BertConfig; token ids stand in for a tokenizer's right-padded
batch.
"""
import sys
import warnings

import numpy as np
import torch
from torch import nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


# ---- peft (trimmed): PromptTuningConfig, PromptEmbedding, PeftModelForFeatureExtraction -------------------------
class PromptTuningConfig:
    peft_type = "PROMPT_TUNING"
    task_type = "FEATURE_EXTRACTION"
    is_prompt_learning = True

    def __init__(self, num_virtual_tokens, token_dim, num_transformer_submodules=1):
        self.num_virtual_tokens = num_virtual_tokens
        self.token_dim = token_dim
        self.num_transformer_submodules = num_transformer_submodules


class PromptEmbedding(nn.Module):
    def __init__(self, config, word_embeddings):
        super().__init__()
        total_virtual_tokens = config.num_virtual_tokens * config.num_transformer_submodules
        self.embedding = nn.Embedding(total_virtual_tokens, config.token_dim)

    def forward(self, indices):
        return self.embedding(indices)


def _get_batch_size(input_ids, inputs_embeds):
    if input_ids is not None:
        return input_ids.shape[0]
    return inputs_embeds.shape[0]


class PeftModelForFeatureExtraction(nn.Module):
    def __init__(self, model, peft_config):
        super().__init__()
        self.base_model = model
        self.config = model.config
        self.peft_config = {"default": peft_config}
        self.active_adapter = "default"
        self.word_embeddings = model.get_input_embeddings()
        self.prompt_encoder = PromptEmbedding(peft_config, self.word_embeddings)
        self.prompt_tokens = torch.arange(peft_config.num_virtual_tokens * peft_config.num_transformer_submodules).long()

    @property
    def active_peft_config(self):
        return self.peft_config[self.active_adapter]

    def get_prompt(self, batch_size):
        prompt_tokens = self.prompt_tokens.unsqueeze(0).expand(batch_size, -1).to(self.prompt_encoder.embedding.weight.device)
        return self.prompt_encoder(prompt_tokens)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        peft_config = self.active_peft_config
        batch_size = _get_batch_size(input_ids, inputs_embeds)
        if attention_mask is not None:
            # concat prompt attention mask
            prefix_attention_mask = torch.ones(batch_size, peft_config.num_virtual_tokens).to(attention_mask.device)
            attention_mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)

        if kwargs.get("position_ids", None) is not None:
            warnings.warn("Position ids are not supported for parameter efficient tuning. Ignoring position ids.")
            kwargs["position_ids"] = None
        if kwargs.get("token_type_ids", None) is not None:
            warnings.warn("Token type ids are not supported for parameter efficient tuning. Ignoring token type ids")
            kwargs["token_type_ids"] = None
        kwargs.update({"attention_mask": attention_mask, "output_attentions": output_attentions,
                       "output_hidden_states": output_hidden_states, "return_dict": return_dict})

        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        prompts = self.get_prompt(batch_size=batch_size)
        prompts = prompts.to(inputs_embeds.dtype)
        inputs_embeds = torch.cat((prompts, inputs_embeds), dim=1)
        return self.base_model(inputs_embeds=inputs_embeds, **kwargs)


# ---- sentence_transformers/models/Transformer.py (forward) ------------------------------------------------------
class Transformer(nn.Module):
    def __init__(self, auto_model):
        super().__init__()
        self.auto_model = auto_model

    def forward(self, features, **kwargs):
        """Returns token_embeddings, cls_token"""
        trans_features = {"input_ids": features["input_ids"], "attention_mask": features["attention_mask"]}
        if "token_type_ids" in features:
            trans_features["token_type_ids"] = features["token_type_ids"]

        output_states = self.auto_model(**trans_features, **kwargs, return_dict=False)
        output_tokens = output_states[0]

        if not FIXED:
            features.update({"token_embeddings": output_tokens, "attention_mask": features["attention_mask"]})
        else:
            # If the AutoModel is wrapped with a PeftModelForFeatureExtraction, then it may have added virtual tokens
            # We need to extend the attention mask to include these virtual tokens, or the pooling will fail
            if (
                isinstance(self.auto_model, PeftModelForFeatureExtraction)
                and self.auto_model.active_peft_config.is_prompt_learning
            ):
                batch_size = output_tokens.size(0)
                attention_mask = features["attention_mask"]
                prefix_attention_mask = torch.ones(
                    batch_size, self.auto_model.active_peft_config.num_virtual_tokens, device=attention_mask.device
                )
                features["attention_mask"] = torch.cat((prefix_attention_mask, attention_mask), dim=1)

            features["token_embeddings"] = output_tokens
        return features


# ---- sentence_transformers/models/Pooling.py (cls mode) ---------------------------------------------------------
class Pooling(nn.Module):
    def __init__(self, word_embedding_dimension, pooling_mode="cls"):
        super().__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_cls_token = pooling_mode == "cls"

    def forward(self, features):
        token_embeddings = features["token_embeddings"]
        output_vectors = []
        if self.pooling_mode_cls_token:
            cls_token = features.get("cls_token_embeddings", token_embeddings[:, 0])  # Take first token by default
            output_vectors.append(cls_token)
        output_vector = torch.cat(output_vectors, 1)
        features["sentence_embedding"] = output_vector
        return features


# ---- sentence_transformers/SentenceTransformer.py (encode, trimmed) ---------------------------------------------
class SentenceTransformer(nn.Sequential):
    def encode(self, batches, output_value="sentence_embedding"):
        all_embeddings = []
        for features in batches:
            with torch.no_grad():
                out_features = self.forward(features)
                if output_value == "token_embeddings":
                    embeddings = []
                    for token_emb, attention in zip(out_features[output_value], out_features["attention_mask"]):
                        last_mask_id = len(attention) - 1
                        while last_mask_id > 0 and attention[last_mask_id].item() == 0:
                            last_mask_id -= 1

                        embeddings.append(token_emb[0 : last_mask_id + 1])
                else:
                    embeddings = out_features[output_value].detach()
            all_embeddings.extend(embeddings)
        return all_embeddings


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    bert = BertModel(config, add_pooling_layer=True).eval()
    peft_config = PromptTuningConfig(num_virtual_tokens=4, token_dim=config.hidden_size)
    peft_model = PeftModelForFeatureExtraction(bert, peft_config).eval()

    model = SentenceTransformer(Transformer(peft_model), Pooling(config.hidden_size, "cls"))

    # a right-padded tokenizer batch: [CLS] ... [SEP] then [PAD]=0
    input_ids = torch.tensor([
        [101, 7, 8, 9, 10, 11, 12, 102],
        [101, 21, 22, 23, 102, 0, 0, 0],
        [101, 31, 102, 0, 0, 0, 0, 0],
    ])
    attention_mask = (input_ids != 0).long()
    features = {"input_ids": input_ids, "attention_mask": attention_mask,
                "token_type_ids": torch.zeros_like(input_ids)}

    warnings.simplefilter("ignore", UserWarning)
    token_embs = model.encode([dict(features)], output_value="token_embeddings")
    for i, emb in enumerate(token_embs):
        print(f"text {i}: {emb.shape[0]} token embeddings, last one starts {np.round(emb[-1, :4].numpy(), 4).tolist()}")
    sent = model.encode([dict(features)])
    print("sentence embeddings (cls):", np.round(torch.stack(sent)[:, :4].numpy(), 4).tolist())


if __name__ == "__main__":
    main()
