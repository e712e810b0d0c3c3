# Correct program (quiet batch quiet-r163a).
# Ported from facebookresearch/nougat @5a92920d342fb6acf05fc9b594ccb4053dbe8e7a: nougat/model.py
# (BARTDecoder.__init__ / prepare_inputs_for_inference / forward, NougatModel.inference) and predict.py
# (a batch of pages decoded together). Nougat is an image-to-markdown encoder-decoder: a Swin encoder
# over a fixed-size page canvas (pages are padded with pixels, no mask) and an MBartForCausalLM decoder
# with cross-attention, its config flipped to is_encoder_decoder=True, and its
# prepare_inputs_for_generation replaced by prepare_inputs_for_inference, which rebuilds the decoder's
# attention_mask from the ids on every step (input_ids.ne(pad)) and hands the model only the last token
# once a KV cache exists. In a batch, a page that reaches </s> is filled with <pad> while the others go
# on, so its later slots are masked out of the cached self-attention.
# The Swin encoder is a small patch-projection stand-in (timm is not used) and generate() is written out
# as the greedy loop transformers 4.3x ran for nougat (this transformers' generate passes keyword
# arguments nougat's prepare_inputs_for_inference does not take); the tokenizer is its special ids.
# Self-check: every page's tokens and per-step scores equal that page decoded alone, without cache and
# without mask, through a decoder forward written by hand from the same weights.
import math
import warnings
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import MBartConfig, MBartForCausalLM
from transformers.file_utils import ModelOutput

warnings.filterwarnings("ignore", category=FutureWarning)
torch.manual_seed(0)
torch.set_num_threads(1)

# nougat/dataset/tokenizer.json: <s>=0, <pad>=1, </s>=2, <unk>=3
TOKENIZER = SimpleNamespace(bos_token_id=0, pad_token_id=1, eos_token_id=2, unk_token_id=3, vocab_size=12)


class SwinEncoder(nn.Module):
    """Stand-in for nougat's SwinEncoder: (B, 3, H, W) page canvas -> (B, N, hidden_dimension)."""

    def __init__(self, input_size, patch_size, hidden_dimension):
        super().__init__()
        self.input_size = input_size
        self.patch_embed = nn.Conv2d(3, hidden_dimension, kernel_size=patch_size, stride=patch_size)
        self.layers = nn.Sequential(
            nn.LayerNorm(hidden_dimension),
            nn.Linear(hidden_dimension, hidden_dimension),
            nn.GELU(),
            nn.Linear(hidden_dimension, hidden_dimension),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        return self.layers(x)


class BARTDecoder(nn.Module):
    def __init__(self, decoder_layer: int, max_position_embeddings: int, hidden_dimension: int = 1024):
        super().__init__()
        self.decoder_layer = decoder_layer
        self.max_position_embeddings = max_position_embeddings
        self.tokenizer = TOKENIZER

        self.model = MBartForCausalLM(
            config=MBartConfig(
                is_decoder=True,
                is_encoder_decoder=False,
                add_cross_attention=True,
                decoder_layers=self.decoder_layer,
                max_position_embeddings=self.max_position_embeddings,
                vocab_size=self.tokenizer.vocab_size,
                scale_embedding=True,
                add_final_layer_norm=True,
                d_model=hidden_dimension,
                decoder_attention_heads=4,
                decoder_ffn_dim=2 * hidden_dimension,
            )
        )
        self.model.config.is_encoder_decoder = True  # to get cross-attention
        self.model.model.decoder.embed_tokens.padding_idx = self.tokenizer.pad_token_id
        self.model.prepare_inputs_for_generation = self.prepare_inputs_for_inference

    def prepare_inputs_for_inference(
        self,
        input_ids: torch.Tensor,
        encoder_outputs: torch.Tensor,
        past=None,
        past_key_values=None,
        use_cache: bool = None,
        attention_mask: torch.Tensor = None,
    ):
        attention_mask = input_ids.ne(self.tokenizer.pad_token_id).long()
        past = past or past_key_values
        if past is not None:
            input_ids = input_ids[:, -1:]
        output = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "past_key_values": past,
            "use_cache": use_cache,
            "encoder_hidden_states": encoder_outputs.last_hidden_state,
        }
        return output

    def forward(
        self,
        input_ids,
        attention_mask: Optional[torch.Tensor] = None,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        past_key_values=None,
        labels: Optional[torch.Tensor] = None,
        use_cache: bool = None,
    ):
        return self.model.forward(
            input_ids,
            attention_mask=attention_mask,
            labels=labels,
            encoder_hidden_states=encoder_hidden_states,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )


def greedy_generate(model, encoder_outputs, max_length, pad_token_id, eos_token_id, bad_token_id):
    """GenerationMixin.generate(do_sample=False, num_beams=1) as transformers 4.3x ran it for nougat."""
    batch_size = encoder_outputs.last_hidden_state.shape[0]
    decoder_start = model.config.decoder_start_token_id
    if decoder_start is None:
        decoder_start = model.config.bos_token_id
    input_ids = torch.full((batch_size, 1), decoder_start, dtype=torch.long)
    model_kwargs = {"encoder_outputs": encoder_outputs, "use_cache": True}
    unfinished_sequences = torch.ones(batch_size, dtype=torch.long)
    scores = ()
    while True:
        model_inputs = model.prepare_inputs_for_generation(input_ids, **model_kwargs)
        outputs = model(**model_inputs, return_dict=True)
        next_token_logits = outputs.logits[:, -1, :]
        # NoBadWordsLogitsProcessor([[unk]]); min_length=1 bans nothing past the start token
        next_tokens_scores = next_token_logits.clone()
        next_tokens_scores[:, bad_token_id] = -float("inf")
        scores += (next_tokens_scores,)
        next_tokens = torch.argmax(next_tokens_scores, dim=-1)
        next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        model_kwargs["past_key_values"] = outputs.cache
        unfinished_sequences = unfinished_sequences.mul((next_tokens != eos_token_id).long())
        if unfinished_sequences.max() == 0 or input_ids.shape[-1] >= max_length:
            break
    return ModelOutput(sequences=input_ids, scores=scores)


class NougatModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = SwinEncoder(config.input_size, config.patch_size, config.hidden_dimension)
        self.decoder = BARTDecoder(
            max_position_embeddings=config.max_position_embeddings,
            decoder_layer=config.decoder_layer,
            hidden_dimension=config.hidden_dimension,
        )

    @torch.no_grad()
    def inference(self, image_tensors: torch.Tensor):
        last_hidden_state = self.encoder(image_tensors)
        encoder_outputs = ModelOutput(last_hidden_state=last_hidden_state, attentions=None)
        decoder_output = greedy_generate(
            self.decoder.model,
            encoder_outputs=encoder_outputs,
            max_length=self.config.max_length,
            pad_token_id=self.decoder.tokenizer.pad_token_id,
            eos_token_id=self.decoder.tokenizer.eos_token_id,
            bad_token_id=self.decoder.tokenizer.unk_token_id,
        )
        return {
            "sequences": decoder_output.sequences.clone(),
            "scores": torch.stack(decoder_output.scores, 1),
            "encoder_hidden_states": last_hidden_state,
        }


def fit_weights(model, image_tensors, page_tokens, steps):
    """Stands in for loading a trained checkpoint: the pages are fitted to their token strings by
    teacher forcing so that greedy decoding ends them at different lengths. Every training row is
    max_length long (what follows </s> is filler the decoder never reads before </s>), so the fitting
    batch has no padding and needs no mask."""
    lm = model.decoder.model
    ids = torch.tensor(page_tokens)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        logits = lm(input_ids=ids[:, :-1], encoder_hidden_states=model.encoder(image_tensors)).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


# ---------------------------------------------------------------- reference, written by hand


def ref_attention(x, mem, attn, n_heads, causal):
    T, D = x.shape
    S = mem.shape[0]
    hd = D // n_heads
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).view(T, n_heads, hd)
    k = (mem @ attn.k_proj.weight.T + attn.k_proj.bias).view(S, n_heads, hd)
    v = (mem @ attn.v_proj.weight.T + attn.v_proj.bias).view(S, n_heads, hd)
    out = torch.zeros(T, n_heads, hd)
    for h in range(n_heads):
        for i in range(T):
            last = i + 1 if causal else S  # keys 0..i under the causal rule, every memory slot otherwise
            p = torch.softmax(k[:last, h] @ q[i, h] / math.sqrt(hd), dim=0)
            out[i, h] = p @ v[:last, h]
    return out.reshape(T, D) @ attn.out_proj.weight.T + attn.out_proj.bias


def ref_decoder_logits(lm, ids, memory):
    """MBart pre-norm decoder over one unpadded sequence, no cache, no mask tensor."""
    dec = lm.model.decoder
    cfg = lm.config
    D = cfg.d_model
    ln = lambda mod, t: F.layer_norm(t, (D,), mod.weight, mod.bias, mod.eps)
    h = dec.embed_tokens.weight[ids] * math.sqrt(D)
    h = h + dec.embed_positions.weight[torch.arange(len(ids)) + 2]
    h = ln(dec.layernorm_embedding, h)
    for layer in dec.layers:
        h = h + ref_attention(ln(layer.self_attn_layer_norm, h), ln(layer.self_attn_layer_norm, h),
                              layer.self_attn, cfg.decoder_attention_heads, causal=True)
        h = h + ref_attention(ln(layer.encoder_attn_layer_norm, h), memory,
                              layer.encoder_attn, cfg.decoder_attention_heads, causal=False)
        y = ln(layer.final_layer_norm, h)
        h = h + (F.gelu(y @ layer.fc1.weight.T + layer.fc1.bias) @ layer.fc2.weight.T + layer.fc2.bias)
    h = ln(dec.layer_norm, h)
    return h @ lm.lm_head.weight.T


def ref_greedy(lm, memory, max_length):
    ids = [TOKENIZER.bos_token_id]
    step_scores = []
    while True:
        logits = ref_decoder_logits(lm, torch.tensor(ids), memory)[-1].clone()
        logits[TOKENIZER.unk_token_id] = -float("inf")
        step_scores.append(logits)
        ids.append(int(logits.argmax()))
        if ids[-1] == TOKENIZER.eos_token_id or len(ids) >= max_length:
            return ids, step_scores


def main():
    config = SimpleNamespace(
        input_size=[16, 12], patch_size=4, hidden_dimension=32, decoder_layer=2,
        max_position_embeddings=32, max_length=14,
    )
    model = NougatModel(config).eval()
    batch_size = 6
    image_tensors = torch.randn(batch_size, 3, *config.input_size)
    bos, eos = TOKENIZER.bos_token_id, TOKENIZER.eos_token_id
    gen = torch.Generator().manual_seed(1)
    page_tokens = []
    for n in [2, 5, 13, 7, 3, 13]:  # 13 tokens: the page is still going at max_length
        body = torch.randint(4, TOKENIZER.vocab_size, (config.max_length - 1,), generator=gen).tolist()
        if n < 13:
            body[n] = eos
        page_tokens.append([bos] + body)
    fit_weights(model, image_tensors, page_tokens, steps=150)
    out = model.inference(image_tensors)
    seqs, scores = out["sequences"], out["scores"]
    pad = TOKENIZER.pad_token_id

    finished_early = 0
    with torch.no_grad():
        for b in range(batch_size):
            memory = out["encoder_hidden_states"][b]
            ref_ids, ref_scores = ref_greedy(model.decoder.model, memory, config.max_length)
            n = len(ref_ids)
            assert pad not in ref_ids, (b, ref_ids)
            assert seqs[b, :n].tolist() == ref_ids, (b, seqs[b].tolist(), ref_ids)
            assert (seqs[b, n:] == pad).all(), (b, seqs[b].tolist())
            for t, s in enumerate(ref_scores):
                keep = torch.isfinite(s)
                assert torch.allclose(scores[b, t][keep], s[keep], atol=1e-4), (b, t)
            if n < seqs.shape[1]:
                finished_early += 1
    # some pages reached </s> and were padded while others kept decoding over the cache
    assert 0 < finished_early < batch_size, finished_early
    assert (seqs[:, -1] != pad).any()
    print("sequences:")
    for row in seqs.tolist():
        print("  ", row)
    print(f"ok: {batch_size} pages, {finished_early} padded after </s>, batched KV-cache greedy == per-page reference")


if __name__ == "__main__":
    main()
