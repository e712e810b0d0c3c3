# huggingface/sentence-transformers#3944, commit 8a73e35a ("Keep the prompt-excluded mask out of the feature dicts")
# With include_prompt=False, Pooling replaced features["attention_mask"] with the prompt-excluded mask. The
# same dict is what the encoder attends over: losses that embed the same dicts again (AdaptiveLayerLoss, once
# per layer and on a repeated call) pooled with the prompt removed twice and ran BERT with the prompt keys masked.
import inspect
import math
import random
import sys
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
random.seed(0)


class Transformer(nn.Module):
    def __init__(self, auto_model, module_output_name="token_embeddings"):
        super().__init__()
        self.auto_model = auto_model
        self.model = auto_model
        self.module_output_name = module_output_name
        self.model_forward_params = set(inspect.signature(self.model.forward).parameters)

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        all_kwargs = {**features, **kwargs, "return_dict": True}
        filtered_kwargs = {key: value for key, value in all_kwargs.items() if key in self.model_forward_params}
        model_output = self.model(**filtered_kwargs)
        features[self.module_output_name] = model_output["last_hidden_state"]
        if (
            hasattr(self.model.config, "output_hidden_states")
            and self.model.config.output_hidden_states
            and "hidden_states" in model_output
        ):
            features["all_layer_embeddings"] = model_output["hidden_states"]
        return features


class Pooling(nn.Module):
    def __init__(self, embedding_dimension: int, pooling_mode="mean", include_prompt: bool = True) -> None:
        super().__init__()
        self.embedding_dimension = embedding_dimension
        self.pooling_mode = pooling_mode
        self.include_prompt = include_prompt

    def forward(self, features: dict[str, Tensor | Any], **kwargs) -> dict[str, Tensor | Any]:
        token_embeddings = features["token_embeddings"]
        prompt_length: int | None = None

        if not self.include_prompt and "prompt_length" in features:
            pl = features["prompt_length"]
            prompt_length = int(pl[0].item()) if isinstance(pl, torch.Tensor) else int(pl)

        if "attention_mask" in features and features["attention_mask"].size(-1) == token_embeddings.size(1):
            attention_mask = features["attention_mask"]
        else:
            attention_mask = torch.ones(token_embeddings.shape[:-1], device=token_embeddings.device, dtype=torch.int64)

        if prompt_length is not None:
            if FIXED:
                attention_mask = self._exclude_prompt_from_mask(attention_mask, prompt_length)
            else:
                attention_mask = self._exclude_prompt_from_mask(attention_mask, prompt_length)
                # Expose the effective pooling mask by replacing the key, not by mutating the
                # input tensor, which the gradient-cached losses re-embed in their backward pass.
                features["attention_mask"] = attention_mask

        output_vectors = self._forward_padded(token_embeddings, attention_mask, features)
        features["sentence_embedding"] = torch.cat(output_vectors, dim=-1)
        return features

    @staticmethod
    def _exclude_prompt_from_mask(attention_mask: Tensor, prompt_length: int) -> Tensor:
        attention_mask = attention_mask.clone()
        pad_lengths = attention_mask.to(torch.int32).argmax(dim=1)
        if pad_lengths.sum() == 0:
            attention_mask[:, :prompt_length] = 0
        else:
            positions = torch.arange(attention_mask.size(1), device=attention_mask.device).unsqueeze(0)
            attention_mask[positions < (pad_lengths + prompt_length).unsqueeze(1)] = 0
        return attention_mask

    def _forward_padded(self, token_embeddings: Tensor, attention_mask: Tensor, features) -> list[Tensor]:
        mask = attention_mask.unsqueeze(-1).expand_as(token_embeddings).to(token_embeddings.dtype)
        mean_sum = (token_embeddings * mask).sum(dim=1)
        mean_mask = torch.clamp(mask.sum(dim=1), min=1e-9)
        return [mean_sum / mean_mask]


class SentenceTransformer(nn.Sequential):
    def forward(self, input: dict[str, Tensor], **kwargs) -> dict[str, Tensor]:
        for module_name, module in self.named_children():
            input = module(input)
        return input


class MultipleNegativesRankingLoss(nn.Module):
    def __init__(self, model, scale: float = 20.0) -> None:
        super().__init__()
        self.model = model
        self.scale = scale

    def forward(self, sentence_features, labels):
        embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
        queries = embeddings[0]
        docs_all = torch.cat(embeddings[1:], dim=0)
        scores = F.normalize(queries, dim=-1) @ F.normalize(docs_all, dim=-1).T * self.scale
        return F.cross_entropy(scores, torch.arange(queries.size(0)))


class TransformerDecorator:
    def __init__(self, transformer: Transformer, original_forward) -> None:
        self.transformer = transformer
        self.original_forward = original_forward
        self.layer_idx = None

    def set_layer_idx(self, layer_idx) -> None:
        self.layer_idx = layer_idx

    def __call__(self, features) -> dict[str, Tensor]:
        if self.layer_idx is None:
            return self.call_grow_cache(features)
        return self.call_use_cache(features)

    def call_grow_cache(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        original_output_hidden_states = self.transformer.auto_model.config.output_hidden_states
        try:
            self.transformer.auto_model.config.output_hidden_states = True
            output = self.original_forward(features)
            self.num_layers = len(output["all_layer_embeddings"])
        finally:
            self.transformer.auto_model.config.output_hidden_states = original_output_hidden_states
        return output

    def call_use_cache(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {**features, "token_embeddings": features["all_layer_embeddings"][self.layer_idx]}


class ForwardDecorator:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.embeddings = []

    def __call__(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        output = self.fn(features)
        self.embeddings.append(output["sentence_embedding"])
        return output

    def get_embeddings(self) -> Tensor:
        embeddings = torch.concat(self.embeddings, dim=0)
        self.embeddings = []
        return embeddings


class AdaptiveLayerLoss(nn.Module):
    def __init__(
        self,
        model: SentenceTransformer,
        loss: nn.Module,
        n_layers_per_step: int = 1,
        last_layer_weight: float = 1.0,
        prior_layers_weight: float = 1.0,
        kl_div_weight: float = 1.0,
        kl_temperature: float = 0.3,
        layer_weighting: Literal["uniform", "log", "linear"] = "uniform",
    ) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.n_layers_per_step = n_layers_per_step
        self.last_layer_weight = last_layer_weight
        self.prior_layers_weight = prior_layers_weight
        self.kl_div_weight = kl_div_weight
        self.kl_temperature = kl_temperature
        self.layer_weighting = layer_weighting

    def get_layer_weight(self, layer_idx: int) -> float:
        if self.layer_weighting == "log":
            return 1.0 / (1.0 + math.log(1 + layer_idx))
        if self.layer_weighting == "linear":
            return 1.0 / (1 + layer_idx)
        return 1.0

    def forward(self, sentence_features, labels: Tensor) -> Tensor:
        unwrapped_model = self.model
        original_transformer_forward = unwrapped_model[0].forward
        transformer_decorator = TransformerDecorator(unwrapped_model[0], original_transformer_forward)
        unwrapped_model[0].forward = transformer_decorator

        original_forward = unwrapped_model.forward
        forward_decorator = ForwardDecorator(original_forward)
        unwrapped_model.forward = forward_decorator

        try:
            loss = self.loss(sentence_features, labels) * self.last_layer_weight
            if self.kl_temperature > 0:
                final_embeddings = forward_decorator.get_embeddings()
                final_embeddings = F.softmax(final_embeddings / self.kl_temperature, dim=-1).detach()

            num_layers = transformer_decorator.num_layers
            layer_indices = range(num_layers - 1)
            if self.n_layers_per_step > 0 and self.n_layers_per_step < num_layers - 1:
                layer_indices = random.sample(layer_indices, self.n_layers_per_step)

            if not layer_indices:
                return loss

            for layer_idx in layer_indices:
                transformer_decorator.set_layer_idx(layer_idx)
                layer_loss = self.loss(sentence_features, labels)
                layer_weight = self.get_layer_weight(layer_idx)
                loss = loss + layer_loss * layer_weight / len(layer_indices) * self.prior_layers_weight

                if self.kl_temperature > 0:
                    embeddings = forward_decorator.get_embeddings()
                    kl_div_loss = F.kl_div(
                        F.log_softmax(embeddings / self.kl_temperature, dim=-1),
                        final_embeddings,
                        reduction="batchmean",
                    )
                    loss = loss + kl_div_loss * self.kl_temperature * self.kl_div_weight
        finally:
            unwrapped_model[0].forward = original_transformer_forward
            unwrapped_model.forward = original_forward

        return loss


CLS, SEP, PAD = 1, 2, 0


def tokenize(text):
    return [5 + (sum(map(ord, word)) % 90) for word in text.lower().replace(".", "").replace(":", "").split()]


def preprocess(texts, prompt=None):
    """Tokenize with the prompt prepended; prompt_length counts [CLS] + the prompt tokens, as sentence-transformers does."""
    prompt_ids = tokenize(prompt) if prompt else []
    rows = [[CLS] + prompt_ids + tokenize(t) + [SEP] for t in texts]
    max_len = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [PAD] * (max_len - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (max_len - len(r)) for r in rows])
    features = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}
    if prompt:
        features["prompt_length"] = 1 + len(prompt_ids)
    return features


config = BertConfig(
    vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
    max_position_embeddings=64, pad_token_id=PAD,
)
config._attn_implementation = "eager"
bert = BertModel(config, add_pooling_layer=False).eval()
model = SentenceTransformer(Transformer(bert), Pooling(64, pooling_mode="mean", include_prompt=False))

features = [
    preprocess(["It is sunny today.", "He drove to work."], prompt="query: "),
    preprocess(["The weather is lovely.", "He took the car."], prompt="query: "),
]

adaptive = AdaptiveLayerLoss(model, MultipleNegativesRankingLoss(model), n_layers_per_step=-1)
with torch.no_grad():
    first = adaptive(features, None).item()
    second = adaptive(features, None).item()
print(f"fixed={FIXED} first={first:.6f} second={second:.6f}")
