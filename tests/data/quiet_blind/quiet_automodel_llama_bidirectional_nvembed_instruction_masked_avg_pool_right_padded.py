# Correct program (quiet batch quiet-r153a).
# Citation: NVIDIA-NeMo/Automodel nemo_automodel/components/models/llama_bidirectional/model.py
#   @04fb006064ea48e6a731aacddf44662207585fa1 (LlamaBidirectionalConfig, LlamaBidirectionalModel: every layer's
#   self_attn.is_causal = False, _update_causal_mask -> a padding-only 4-D mask; _pool "avg"), with the instruction
#   masking of nvidia/NV-Embed-v1 modeling_nvembed.py (NVEmbedModel.add_pad_token: pad = eos, padding_side "right";
#   prepare_kwargs_from_batch: pool_mask = attention_mask.clone(), pool_mask[:, :instruction_lens] = 0, with
#   instruction_lens = len(tokenizer.tokenize(instruction)); encode appends eos to each text).
# Ported to transformers 5 (the decoder layer takes `cache=`, LlamaModel has no cache_position, and the padding-only
# mask comes from masking_utils.create_bidirectional_mask instead of the deprecated _prepare_4d_attention_mask): a tiny LlamaConfig,
# sdpa and eager. A right-padded batch of "instruction + query + eos" rows: the 4-D mask only hides the padding keys
# (bidirectional over the real tokens), and mean pooling runs over the query tokens and eos, leaving out the
# instruction prefix and the pads. Checked against each text run alone, unpadded, and pooled over its own query span.
from typing import Optional

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaModel

torch.manual_seed(0)


class LlamaBidirectionalConfig(LlamaConfig):
    model_type = "llama_bidirec"

    def __init__(self, pooling: str = "avg", temperature: float = 1.0, **kwargs):
        self.pooling = pooling
        self.temperature = temperature
        super().__init__(**kwargs)


class LlamaBidirectionalModel(LlamaModel):
    config_class = LlamaBidirectionalConfig

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        for layer in self.layers:
            layer.self_attn.is_causal = False

    def _update_causal_mask(self, attention_mask: torch.Tensor, input_tensor: Optional[torch.Tensor] = None, **kwargs):
        if attention_mask is None:
            return None
        # transformers 5: the padding-only (non-causal) mask in the form the configured attention wants
        # (None when nothing is padded, bool for sdpa, additive float for eager)
        return create_bidirectional_mask(
            config=self.config, inputs_embeds=input_tensor, attention_mask=attention_mask
        )

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = self._update_causal_mask(attention_mask=attention_mask, input_tensor=inputs_embeds)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


def _pool(last_hidden_states: torch.Tensor, attention_mask: torch.Tensor, pool_type: str) -> torch.Tensor:
    last_hidden = last_hidden_states.masked_fill(~attention_mask[..., None].bool(), 0.0)

    if pool_type == "avg":
        emb = last_hidden.sum(dim=1) / attention_mask.sum(dim=1)[..., None]
    elif pool_type == "cls":
        emb = last_hidden[:, 0]
    elif pool_type == "last":
        left_padding = attention_mask[:, -1].sum() == attention_mask.shape[0]
        if left_padding:
            emb = last_hidden[:, -1]
        else:
            sequence_lengths = attention_mask.sum(dim=1) - 1
            batch_size = last_hidden.shape[0]
            emb = last_hidden[torch.arange(batch_size, device=last_hidden.device), sequence_lengths]
    else:
        emb = last_hidden[:, 0]

    return emb


class WordTokenizer:
    """A whitespace tokenizer standing in for the Llama tokenizer (no BOS; eos doubles as pad, as NV-Embed sets it)."""

    def __init__(self, words):
        self.eos_token = "</s>"
        self.vocab = {self.eos_token: 2}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab) + 3)
        self.pad_token = None
        self.padding_side = "left"

    @property
    def pad_token_id(self):
        return self.vocab[self.pad_token]

    def tokenize(self, text):
        return text.replace(self.eos_token, " " + self.eos_token).split()

    def __call__(self, texts, padding=True, return_tensors="pt"):
        ids = [[self.vocab[t] for t in self.tokenize(text)] for text in texts]
        longest = max(len(x) for x in ids)
        input_ids, attention_mask = [], []
        for x in ids:
            pad = [self.pad_token_id] * (longest - len(x))
            mask = [1] * len(x)
            if self.padding_side == "right":
                input_ids.append(x + pad)
                attention_mask.append(mask + [0] * len(pad))
            else:
                input_ids.append(pad + x)
                attention_mask.append([0] * len(pad) + mask)
        return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


class BidirectionalEmbedder(torch.nn.Module):
    def __init__(self, config: LlamaBidirectionalConfig, tokenizer: WordTokenizer, padding_side="right"):
        super().__init__()
        self.embedding_model = LlamaBidirectionalModel(config)
        self.tokenizer = tokenizer
        self.padding_side = padding_side
        self.is_mask_instruction = True
        self.add_eos = True
        self.add_pad_token()

    def add_pad_token(self):
        self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = self.padding_side

    def prepare_kwargs_from_batch(self, batch_dict: dict, instruction_lens: int):
        attention_mask = batch_dict["attention_mask"].clone()
        if self.padding_side == "right" and self.is_mask_instruction and instruction_lens > 0:
            attention_mask[:, :instruction_lens] = 0
        return {
            "input_ids": batch_dict["input_ids"].long(),
            "attention_mask": batch_dict["attention_mask"],
            "pool_mask": attention_mask,
        }

    def forward(self, input_ids, attention_mask, pool_mask=None):
        outputs = self.embedding_model(input_ids=input_ids, attention_mask=attention_mask)
        pool_mask = attention_mask if pool_mask is None else pool_mask
        embeds = _pool(outputs.last_hidden_state, pool_mask, self.embedding_model.config.pooling)
        return {"sentence_embeddings": embeds}

    @torch.no_grad()
    def encode(self, prompts, instruction=""):
        if self.padding_side == "right" and self.is_mask_instruction and len(instruction) > 0:
            instruction_lens = len(self.tokenizer.tokenize(instruction))
        else:
            instruction_lens = 0
        eos = self.tokenizer.eos_token if self.add_eos else ""
        batch_dict = self.tokenizer([instruction + prompt + eos for prompt in prompts], padding=True)
        features = self.prepare_kwargs_from_batch(batch_dict, instruction_lens)
        return self.forward(**features)["sentence_embeddings"]


def reference_embedding(model: LlamaBidirectionalModel, tokenizer: WordTokenizer, instruction, prompt):
    """One text, no padding and no mask: full attention; average the hidden states after the instruction."""
    n_instr = len(tokenizer.tokenize(instruction))
    ids = [tokenizer.vocab[t] for t in tokenizer.tokenize(instruction + prompt + tokenizer.eos_token)]
    hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return hidden[n_instr:].mean(dim=0)


def main():
    instruction = "Instruct: Given a question , retrieve passages that answer it \nQuery: "
    queries = [
        "how do tides work",
        "what is the boiling point of water at altitude in the mountains",
        "rope scaling",
        "why are leaves green in summer",
    ]
    words = set(instruction.split())
    for q in queries:
        words.update(q.split())
    tokenizer = WordTokenizer(sorted(words))

    for attn_implementation in ("sdpa", "eager"):
        config = LlamaBidirectionalConfig(
            vocab_size=len(tokenizer.vocab) + 8,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            pad_token_id=tokenizer.vocab[tokenizer.eos_token],
            pooling="avg",
        )
        config._attn_implementation = attn_implementation
        torch.manual_seed(0)
        embedder = BidirectionalEmbedder(config, tokenizer, padding_side="right").double().eval()

        batch = embedder.encode(queries, instruction=instruction)
        with torch.no_grad():
            ref = torch.stack([reference_embedding(embedder.embedding_model, tokenizer, instruction, q) for q in queries])
        err = (batch - ref).abs().max().item()
        print(f"{attn_implementation}: batched vs per-text embeddings max |diff| = {err:.2e}")
        assert err < 1e-6, err  # eager takes its softmax in float32

        # The attention really is bidirectional: the query's last word changes the hidden state of its first one.
        with torch.no_grad():
            a = tokenizer([instruction + "how do tides work" + tokenizer.eos_token])["input_ids"]
            b = tokenizer([instruction + "how do tides summer" + tokenizer.eos_token])["input_ids"]
            first_query_pos = len(tokenizer.tokenize(instruction))
            ha = embedder.embedding_model(input_ids=a).last_hidden_state[0, first_query_pos]
            hb = embedder.embedding_model(input_ids=b).last_hidden_state[0, first_query_pos]
        assert (ha - hb).abs().max().item() > 1e-6

        scores = torch.nn.functional.normalize(batch, dim=-1) @ torch.nn.functional.normalize(batch, dim=-1).T
        print(f"{attn_implementation}: cosine scores\n{scores}")


if __name__ == "__main__":
    main()
