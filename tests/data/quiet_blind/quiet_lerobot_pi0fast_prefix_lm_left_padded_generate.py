# Citation: huggingface/lerobot src/lerobot/policies/pi0fast/modeling_pi0fast.py @2260e5a5c97fafc40a4fd7c8614fed628a19247d
#   (block_causal_update_causal_mask, prepare_inputs_for_generation, PI0FAST.create_token_type_ids /
#   create_input_tokens / shift_padding_side / embed_inputs / forward / generate_actions).
# pi0+FAST on a tiny PaliGemma (transformers' PaliGemmaForConditionalGeneration built from a config, eager attention):
#   the prefix (image tokens, then "Task: ..., State: ...;\n") attends both ways, the FAST action tokens after it are
#   causal. Training pads the batch on the right; generation shifts the padding to the left and decodes greedily with a
#   KV cache. Each row has its own prefix length (its own task text). Trimmed: a toy word-level tokenizer and a toy
#   action tokenizer stand in for the Hub's PaliGemma / FAST tokenizers, HF's generate() is written out as its loop,
#   the FAST decoding of tokens back to actions is left out.
# Checks: the right-padded training loss equals a per-sample loss under a prefix-LM mask built by a double loop, and the
#   left-padded batched generation gives each row the logits and tokens of that row run alone, unpadded.
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from transformers import DynamicCache, PaliGemmaConfig, PaliGemmaForConditionalGeneration

OBS_STATE = "observation.state"
ACTION = "action"
OBS_IMAGE = "observation.images.top"


@dataclass
class PI0FASTConfig:
    chunk_size: int = 4
    max_action_dim: int = 3
    max_state_dim: int = 4
    fast_skip_tokens: int = 10
    max_decoding_steps: int = 6
    padding_side: str = "right"
    use_cache: bool = True
    precision: str = "float32"
    freeze_vision_encoder: bool = True
    freeze_lm_head: bool = True


class ToyTokenizer:
    """Word-level stand-in for the PaliGemma tokenizer: pad 0, eos 1, bos 2, right padding."""

    pad_token_id = 0
    eos_token_id = 1
    bos_token_id = 2
    vocab_size = 300
    padding_side = "right"

    def __init__(self):
        self.vocab = {}

    def _encode(self, text):
        ids = []
        for word in text.replace("\n", " \n ").split(" "):
            if word == "":
                continue
            if word not in self.vocab:
                self.vocab[word] = 3 + len(self.vocab)
            ids.append(self.vocab[word])
        return ids

    def __call__(self, texts, add_special_tokens=True, return_tensors="pt", padding="longest", truncation=False):
        if isinstance(texts, str):
            texts = [texts]
        ids = [([self.bos_token_id] if add_special_tokens else []) + self._encode(t) for t in texts]
        masks = [[1] * len(x) for x in ids]
        return self.pad({"input_ids": ids, "attention_mask": masks}, padding=padding, return_tensors=return_tensors)

    def pad(self, encoded, padding="longest", max_length=None, return_tensors="pt"):
        ids = [list(x) for x in encoded["input_ids"]]
        masks = [list(x) for x in encoded.get("attention_mask", [[1] * len(x) for x in ids])]
        longest = max(len(x) for x in ids)
        out_ids, out_masks = [], []
        for x, m in zip(ids, masks, strict=True):
            n = longest - len(x)
            if self.padding_side == "right":
                out_ids.append(x + [self.pad_token_id] * n)
                out_masks.append(m + [0] * n)
            else:
                out_ids.append([self.pad_token_id] * n + x)
                out_masks.append([0] * n + m)
        return {"input_ids": torch.tensor(out_ids, dtype=torch.long),
                "attention_mask": torch.tensor(out_masks, dtype=torch.long)}


class ToyFastTokenizer:
    """Stand-in for physical-intelligence/fast: quantized codes, a trailing run of one code kept once (varying length)."""

    def __call__(self, actions_norm):
        out = []
        for a in actions_norm:
            codes = torch.clamp(((a.flatten() + 1) * 20).round().long(), 0, 40).tolist()
            while len(codes) > 1 and codes[-1] == codes[-2]:
                codes.pop()
            out.append(codes)
        return out


def block_causal_update_causal_mask(
    attention_mask,
    token_type_ids=None,
    past_key_values=None,
    cache_position=None,
    input_tensor=None,
    attn_implementation: str = "eager",
    dtype: torch.dtype = "float32",
):
    """
    Update the causal mask during training and generation. It can be customized to different attention masks.
    """
    if attn_implementation == "flash_attention_2":
        if attention_mask is not None and 0.0 in attention_mask:
            return attention_mask
        return None
    min_dtype = torch.finfo(dtype).min

    if input_tensor is None:
        input_tensor = attention_mask

    inputs_lead_dim, sequence_length = input_tensor.shape[:2]

    target_length = (
        attention_mask.shape[-1]
        if isinstance(attention_mask, torch.Tensor)
        else cache_position[0] + sequence_length + 1
    )

    # Handle precomputed attention masks
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask

    # Causal mask initialization
    causal_mask = torch.full(
        (sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=cache_position.device
    )

    # Standard causal masking (triu ensures tokens can only attend to past)
    if sequence_length != 1:
        causal_mask = torch.triu(causal_mask, diagonal=1)

        # Apply block causal mask
        if token_type_ids is not None:
            token_type_ids = token_type_ids.to(causal_mask.device).bool()
            cumsum = torch.cumsum(token_type_ids, dim=1)
            block_causal_mask = cumsum[:, None, :] <= cumsum[:, :, None]

            # Combine causal_mask with block-wise attention mask
            causal_mask = torch.where(block_causal_mask, 0.0, causal_mask)
            causal_mask = causal_mask[:, None, :, :]
        else:
            # Apply past cache position constraint
            causal_mask *= torch.arange(target_length, device=cache_position.device) > cache_position.reshape(
                -1, 1
            )
            causal_mask = causal_mask[None, None, :, :].expand(inputs_lead_dim, 1, -1, -1)
    else:
        # Apply past cache position constraint
        causal_mask *= torch.arange(target_length, device=cache_position.device) > cache_position.reshape(
            -1, 1
        )
        causal_mask = causal_mask[None, None, :, :].expand(inputs_lead_dim, 1, -1, -1)

    if attention_mask is not None:
        causal_mask = causal_mask.clone()  # Copy to contiguous memory for in-place edits
        mask_length = attention_mask.shape[-1]

        # Apply padding mask
        padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(
            causal_mask.device
        )
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
            padding_mask, min_dtype
        )

    return causal_mask


def prepare_inputs_for_generation(
    input_ids,
    past_key_values=None,
    inputs_embeds=None,
    cache_position=None,
    position_ids=None,
    attention_mask=None,
    token_type_ids=None,
    self=None,
):
    # create block causal attention
    if cache_position[0] > 0 and input_ids.shape[1] > 0:
        input_tensor = input_ids[:, -1:]
        new_positions = (
            torch.ones(
                (position_ids.shape[0], input_ids.shape[1]),
                dtype=position_ids.dtype,
                device=position_ids.device,
            ).cumsum(-1)
            + position_ids[:, -1:]
        )
        position_ids = torch.cat([position_ids, new_positions], dim=-1)
    else:
        input_tensor = inputs_embeds
    attention_mask = block_causal_update_causal_mask(
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        cache_position=cache_position,
        input_tensor=input_tensor,
        token_type_ids=token_type_ids,
        dtype=self.dtype,
        attn_implementation=self.config.text_config._attn_implementation,
    )
    # What the language model's prepare_inputs_for_generation does with a cache: only the new token goes in.
    if cache_position[0] > 0:
        model_inputs = {"input_ids": input_ids[:, -1:], "inputs_embeds": None}
        position_ids = position_ids[:, -input_tensor.shape[1]:]
    else:
        model_inputs = {"input_ids": None, "inputs_embeds": inputs_embeds}
    model_inputs.update(
        attention_mask=attention_mask,
        position_ids=position_ids.clone(),
        cache=past_key_values,
        use_cache=True,
    )
    # Position_ids in Paligemma are 1-indexed
    if model_inputs.get("position_ids") is not None:
        model_inputs["position_ids"] += 1
    return model_inputs


class PI0FAST(nn.Module):
    def __init__(self, config: PI0FASTConfig):
        super().__init__()
        self.config = config
        self.paligemma_tokenizer = ToyTokenizer()
        self.fast_tokenizer = ToyFastTokenizer()
        self.fast_skip_tokens = self.config.fast_skip_tokens
        self.action_horizon = self.config.chunk_size
        self.pad_token_id = self.paligemma_tokenizer.pad_token_id

        paligemma_config = PaliGemmaConfig(
            bos_token_id=2,
            eos_token_id=1,
            hidden_size=32,
            image_token_index=300,
            pad_token_id=0,
            projection_dim=32,
            text_config={
                "hidden_activation": "gelu_pytorch_tanh",
                "hidden_size": 32,
                "intermediate_size": 64,
                "model_type": "gemma",
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "vocab_size": 300,
            },
            vision_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "model_type": "siglip_vision_model",
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "image_size": 28,
                "patch_size": 14,
                "projection_dim": 32,
                "vision_use_head": False,
            },
        )
        paligemma_config._attn_implementation = "eager"
        paligemma_config.text_config._attn_implementation = "eager"
        paligemma_config.vision_config._attn_implementation = "eager"
        self.pi0_paligemma = PaliGemmaForConditionalGeneration(config=paligemma_config)
        self.set_requires_grad()
        self.ignore_index = -100
        self.padding_side = self.config.padding_side

    def set_requires_grad(self):
        if self.config.freeze_vision_encoder:
            self.pi0_paligemma.model.vision_tower.eval()
            for params in self.pi0_paligemma.model.vision_tower.parameters():
                params.requires_grad = False

    def embed_tokens(self, tokens: torch.Tensor):
        return self.pi0_paligemma.get_input_embeddings()(tokens)

    def prepare_images(self, batch):
        img = batch[OBS_IMAGE] * 2.0 - 1.0
        mask = torch.ones(img.shape[0], dtype=torch.bool, device=img.device)
        return [img], [mask]

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        mins = actions.amin(dim=(1, 2), keepdim=True)  # [0]
        maxs = actions.amax(dim=(1, 2), keepdim=True)  # [0]
        return 2 * (actions - mins) / (maxs - mins + 1e-8) - 1

    def _act_tokens_to_paligemma_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.paligemma_tokenizer.vocab_size - 1 - self.fast_skip_tokens - tokens
        return out

    def fast_tokenizer_wrapper(self, actions_norm):
        batch_tokens = self.fast_tokenizer(actions_norm)
        fast_out = self.paligemma_tokenizer.pad({"input_ids": batch_tokens}, return_tensors="pt")
        return fast_out

    def create_token_type_ids(self, padded_mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
        token_type_ids = torch.zeros_like(padded_mask, dtype=torch.bool)
        # Compute cumulative sum mask
        cumsum_mask = (padded_mask != 0).cumsum(dim=1)
        # Suffix block (everything after prefix_len)
        suffix_mask = cumsum_mask > prefix_len
        token_type_ids = suffix_mask
        return token_type_ids

    def create_input_tokens(self, state, lang_text, actions=None):
        bsize = state.shape[0]
        device = state.device
        bins = torch.linspace(-1, 1, 256 + 1, device=device)[:-1]
        discretized = torch.bucketize(state, bins) - 1
        discretized = discretized[:, :32]

        prefix_texts = []
        for txt, disc in zip(lang_text, discretized, strict=False):
            cleaned = txt.lower().strip().replace("_", " ")
            state_str = " ".join(str(val.item()) for val in disc)
            prefix_texts.append(f"Task: {cleaned}, State: {state_str};\n")

        prefix_out = self.paligemma_tokenizer(
            prefix_texts, add_special_tokens=True, return_tensors="pt", padding="longest", truncation=False
        )
        prefix_ids = prefix_out["input_ids"].to(device)
        prefix_mask = prefix_out["attention_mask"].to(device)
        prefix_lens = prefix_mask.sum(dim=1)[:, None].cpu()

        if actions is not None:
            actions_norm = self.normalize_actions(actions)
            actions_pad = F.pad(
                actions_norm, (0, max(0, self.config.max_action_dim - actions_norm.shape[2])), value=0
            )[:, :, : self.config.max_action_dim]
            fast_out = self.fast_tokenizer_wrapper(actions_pad.cpu())
            act_ids = fast_out["input_ids"]
            act_mask = fast_out["attention_mask"].to(device)

            act_ids = self._act_tokens_to_paligemma_tokens(act_ids).to(device)
            # Replace action with 0 to pad tokens
            act_ids = torch.where(
                act_ids == self.paligemma_tokenizer.vocab_size - 1 - self.fast_skip_tokens,
                self.pad_token_id,
                act_ids,
            )

            eos_token = torch.tensor(
                [self.paligemma_tokenizer.eos_token_id], dtype=torch.long, device=device
            ).expand(bsize, -1)
            eos_mask = torch.tensor([1], dtype=torch.long, device=device).expand(bsize, -1)
            bos = self.paligemma_tokenizer("Action: ", add_special_tokens=False, return_tensors="pt")
            bos_token = bos["input_ids"].expand(act_ids.shape[0], -1).to(device)
            bos_mask = bos["attention_mask"].expand(act_ids.shape[0], -1).to(device)
            act_ids = torch.cat([bos_token, act_ids, eos_token], dim=1)
            act_mask = torch.cat([bos_mask, act_mask, eos_mask], dim=1)
            act_mask = act_mask.to(device)
        else:
            act_ids = torch.empty(bsize, self.pad_token_id, dtype=torch.long, device=device)
            act_mask = torch.empty(bsize, 0, dtype=torch.long, device=device)
        final_ids = torch.cat([prefix_ids, act_ids], dim=1)

        final_mask = torch.cat([prefix_mask, act_mask], dim=1)
        batch_inputs = {"input_ids": final_ids.tolist(), "attention_mask": final_mask.tolist()}

        # Use tokenizer pad function
        padded_output = self.paligemma_tokenizer.pad(
            batch_inputs, padding="longest", max_length=180, return_tensors="pt"
        )
        padded_mask = padded_output["attention_mask"]

        # define tensor of padding lengths
        att_mask = (padded_mask != 0).cumsum(dim=1) > prefix_lens

        token_type_ids = self.create_token_type_ids(padded_mask=padded_mask, prefix_len=prefix_lens)

        padded_output["padded_mask"] = padded_output.pop("attention_mask")
        padded_output["attention_mask"] = att_mask
        # loss is computed not on prefix, and not on padding
        padded_output["loss_mask"] = att_mask & padded_output["padded_mask"]
        padded_output["token_type_ids"] = token_type_ids
        return padded_output

    def shift_padding_side(
        self,
        tokens: torch.Tensor,
        ar_mask: torch.Tensor,
        padding_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        targets: torch.Tensor,
        token_type_ids: torch.Tensor,
        padding_side: str = "right",
    ) -> tuple[torch.Tensor]:
        if padding_side not in ["right", "left"]:
            return tokens, ar_mask, padding_mask, loss_mask, targets, token_type_ids

        new_tokens = torch.empty_like(tokens)
        new_ar_masks = torch.empty_like(ar_mask)
        new_padding_mask = torch.empty_like(padding_mask)
        new_loss_mask = torch.empty_like(loss_mask)
        new_targets = torch.empty_like(targets)
        new_token_type_ids = torch.empty_like(token_type_ids)
        batch_size = tokens.shape[0]
        for i in range(batch_size):
            padding_indices = torch.where(padding_mask[i] == 0)[0]
            non_padding_indices = torch.where(padding_mask[i] == 1)[0]
            if padding_side == "left":
                new_indices = torch.cat((padding_indices, non_padding_indices), dim=0)
            else:
                new_indices = torch.cat((non_padding_indices, padding_indices), dim=0)
            new_tokens[i] = tokens[i].index_select(0, new_indices)
            new_ar_masks[i] = ar_mask[i].index_select(0, new_indices)
            new_padding_mask[i] = padding_mask[i].index_select(0, new_indices)
            new_loss_mask[i] = loss_mask[i].index_select(0, new_indices)
            new_targets[i] = targets[i].index_select(0, new_indices)
            new_token_type_ids[i] = token_type_ids[i].index_select(0, new_indices)

        return new_tokens, new_ar_masks, new_padding_mask, new_loss_mask, new_targets, new_token_type_ids

    def forward(self, batch: dict[str, Tensor]):
        device = batch[OBS_STATE].device
        images, img_masks = self.prepare_images(batch)

        padded_outs = self.create_input_tokens(
            state=batch[OBS_STATE],
            lang_text=batch["task"],
            actions=batch[ACTION],
        )

        embs, pad_masks, _, targets, loss_mask, token_type_ids = self.embed_inputs(
            images,
            img_masks,
            padded_outs["input_ids"],
            padded_outs["padded_mask"],
            padded_outs["attention_mask"],
            padded_outs["loss_mask"],
            padded_outs["token_type_ids"],
            padding_side=self.padding_side,
        )
        position_ids = torch.cumsum(pad_masks, dim=1) - 1
        token_type_ids = token_type_ids.to(dtype=torch.int64)
        past_seen_tokens = 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + embs.shape[1], device=embs.device)
        pad_masks = block_causal_update_causal_mask(
            attention_mask=pad_masks,
            past_key_values=None,
            cache_position=cache_position,
            input_tensor=embs,
            token_type_ids=token_type_ids,
            dtype=self.pi0_paligemma.dtype,
            attn_implementation=self.pi0_paligemma.config.text_config._attn_implementation,
        )
        outputs = self.pi0_paligemma.forward(
            input_ids=None,
            token_type_ids=None,
            attention_mask=pad_masks,
            position_ids=position_ids,
            inputs_embeds=embs,
            use_cache=False,
            labels=None,
        )

        logits = outputs.logits

        loss_fct = nn.CrossEntropyLoss(reduction="none")

        # Shift left for next-step prediction
        logits = logits[:, :-1, :]
        targets = targets[:, 1:].to(device)  # Shift targets
        loss_mask = loss_mask[:, 1:].to(device)  # Ensure correct shape

        # Compute per-token loss
        token_loss = loss_fct(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        # Apply loss mask
        token_loss = token_loss * loss_mask.reshape(-1)

        # Compute final loss
        loss = token_loss.sum() / torch.clamp(loss_mask.sum(), min=1)

        # Return loss dictionary
        loss_dict = {"ce_loss": loss.item(), "loss": loss}
        return loss_dict

    @torch.no_grad()
    def generate_actions(self, batch: dict[str, Tensor]):
        images, img_masks = self.prepare_images(batch)

        padded_outs = self.create_input_tokens(state=batch[OBS_STATE], lang_text=batch["task"], actions=None)
        embs, pad_masks, att_masks2, targets, loss_mask, token_type_ids = self.embed_inputs(
            images,
            img_masks,
            padded_outs["input_ids"],
            padded_outs["padded_mask"],
            padded_outs["attention_mask"],
            padded_outs["loss_mask"],
            padded_outs["token_type_ids"],
            padding_side="left",
        )
        token_type_ids = token_type_ids.to(dtype=torch.int64)
        prefix_position_ids = torch.cumsum(pad_masks, dim=1) - 1
        return self.greedy_generate(
            attention_mask=pad_masks,
            position_ids=prefix_position_ids,
            inputs_embeds=embs,
            max_new_tokens=self.config.max_decoding_steps,
            token_type_ids=token_type_ids,
        )

    def greedy_generate(self, attention_mask, position_ids, inputs_embeds, max_new_tokens, token_type_ids):
        """GenerationMixin's greedy loop (do_sample=False, num_beams=1, use_cache=True) over the patched
        prepare_inputs_for_generation, written out."""
        bsize = inputs_embeds.shape[0]
        input_ids = torch.empty(bsize, 0, dtype=torch.long, device=inputs_embeds.device)
        past_key_values = DynamicCache(config=self.pi0_paligemma.config.text_config)
        cache_position = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
        step_logits = []
        for _ in range(max_new_tokens):
            model_inputs = prepare_inputs_for_generation(
                input_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                cache_position=cache_position,
                position_ids=position_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                self=self.pi0_paligemma,
            )
            outputs = self.pi0_paligemma(**model_inputs)
            next_token_logits = outputs.logits[:, -1, :].float()
            step_logits.append(next_token_logits)
            next_tokens = torch.argmax(next_token_logits, dim=-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            past_key_values = outputs.cache
            # _update_model_kwargs_for_generation
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((bsize, 1))], dim=-1)
            token_type_ids = torch.cat([token_type_ids, token_type_ids[:, -1].unsqueeze(-1)], dim=-1)
            cache_position = cache_position[-1:] + 1
        return input_ids, torch.stack(step_logits, dim=1)

    def embed_image(self, image: torch.Tensor):
        # Handle different transformers versions
        out = self.pi0_paligemma.get_image_features(image)
        return out.pooler_output if hasattr(out, "pooler_output") else out

    def embed_inputs(
        self,
        images,
        img_masks,
        tokens,
        pad_mask,
        ar_mask,
        loss_mask,
        token_type_ids,
        padding_side: str = "right",
    ):
        device = images[0].device
        all_images = torch.stack(images, dim=1).to(device)
        b, n, c, h, w = all_images.shape
        all_images = all_images.view(b * n, c, h, w)
        embedded = self.embed_image(all_images).to(device)
        b_n, p, image_embedding_dim = embedded.shape  # Extract current dimensions
        m = b_n // b  # Compute the number of images per sample dynamically

        # Reshape dynamically
        embedded = embedded.view(b, m, p, image_embedding_dim)
        tokens_embs = self.embed_tokens(tokens.to(device))

        img_masks = torch.stack(img_masks, dim=1).unsqueeze(-1).to(device)
        num_img_emb = embedded.shape[2]
        img_pad_masks = img_masks.repeat(1, 1, num_img_emb).view(b, -1)
        img_att_masks = torch.zeros((b, n, num_img_emb), dtype=torch.long, device=device).reshape(b, -1)

        image_target_tokens = (
            torch.ones((b, n, num_img_emb), dtype=torch.long, device=device) * self.pad_token_id
        ).reshape(b, -1)
        image_loss_mask = torch.zeros((b, n, num_img_emb), dtype=torch.long, device=device).reshape(b, -1)

        embedded = embedded.reshape(b, n * num_img_emb, image_embedding_dim)  # Shape: (B, N*P, D)

        embs = torch.cat([embedded, tokens_embs], dim=1).to(device)
        pad_masks = torch.cat([img_pad_masks, pad_mask.to(device)], dim=1)
        att_masks = torch.cat([img_att_masks, ar_mask.to(device)], dim=1)
        loss_masks = torch.cat([image_loss_mask, loss_mask.to(device)], dim=1)
        targets = torch.cat([image_target_tokens, tokens.to(device)], dim=1)
        token_type_ids = torch.cat([img_att_masks, token_type_ids.to(device)], dim=1)

        # Shift pad tokens to the left (.generate()) or right (.train())
        embs, att_masks, pad_masks, loss_masks, targets, token_type_ids = self.shift_padding_side(
            embs, att_masks, pad_masks, loss_masks, targets, token_type_ids, padding_side=padding_side
        )

        targets = torch.where(targets == self.pad_token_id, self.ignore_index, targets)
        return embs, pad_masks, att_masks, targets, loss_masks, token_type_ids


# ----------------------------------------------------------------------------------------------------------------
# References: each sample alone, no padding.

def reference_loss(model, batch):
    """Sum of per-sample losses and token counts, each sample unpadded, prefix-LM mask from a double loop."""
    total, count = 0.0, 0
    bsize = batch[OBS_STATE].shape[0]
    for i in range(bsize):
        one = {k: (v[i:i + 1] if isinstance(v, torch.Tensor) else v[i:i + 1]) for k, v in batch.items()}
        outs = model.create_input_tokens(state=one[OBS_STATE], lang_text=one["task"], actions=one[ACTION])
        keep = outs["padded_mask"][0].bool()
        ids = outs["input_ids"][0][keep]
        is_suffix = outs["token_type_ids"][0][keep]
        images, _ = model.prepare_images(one)
        img = model.embed_image(images[0])[0]
        embs = torch.cat([img, model.embed_tokens(ids)], dim=0)[None]
        suffix = torch.cat([torch.zeros(img.shape[0], dtype=torch.bool), is_suffix])
        seq = embs.shape[1]
        mask = torch.full((1, 1, seq, seq), torch.finfo(torch.float32).min)
        for q in range(seq):
            for k in range(seq):
                # prefix keys are seen by every query; a suffix key only by itself and later queries
                if (not suffix[k]) or k <= q:
                    mask[0, 0, q, k] = 0.0
        logits = model.pi0_paligemma(inputs_embeds=embs, attention_mask=mask,
                                     position_ids=torch.arange(seq)[None], use_cache=False).logits[0]
        targets = torch.cat([torch.full((img.shape[0],), -100), ids])
        targets = torch.where(targets == model.pad_token_id, -100, targets)
        tgt_is_suffix = suffix[1:]
        token_loss = F.cross_entropy(logits[:-1], targets[1:], ignore_index=-100, reduction="none")
        total = total + (token_loss * tgt_is_suffix).sum()
        count += int(tgt_is_suffix.sum())
    return total / count


@torch.no_grad()
def reference_generate(model, batch, steps):
    """Each sample alone: the whole prefix seen both ways (a zero 4-D mask), then transformers' own masks."""
    rows_tokens, rows_logits = [], []
    for i in range(batch[OBS_STATE].shape[0]):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        outs = model.create_input_tokens(state=one[OBS_STATE], lang_text=one["task"], actions=None)
        ids = outs["input_ids"][0][outs["padded_mask"][0].bool()]
        images, _ = model.prepare_images(one)
        embs = torch.cat([model.embed_image(images[0])[0], model.embed_tokens(ids)], dim=0)[None]
        seq = embs.shape[1]
        cache = DynamicCache(config=model.pi0_paligemma.config.text_config)
        out = model.pi0_paligemma(inputs_embeds=embs, attention_mask=torch.zeros(1, 1, seq, seq),
                                  cache=cache, use_cache=True)
        tokens, logits = [], []
        for t in range(steps):
            step = out.logits[0, -1].float()
            logits.append(step)
            tok = int(step.argmax())
            tokens.append(tok)
            out = model.pi0_paligemma(input_ids=torch.tensor([[tok]]), cache=cache,
                                      attention_mask=torch.ones(1, seq + t + 1, dtype=torch.long), use_cache=True)
        rows_tokens.append(tokens)
        rows_logits.append(torch.stack(logits))
    return torch.tensor(rows_tokens), torch.stack(rows_logits)


def main():
    torch.manual_seed(0)
    config = PI0FASTConfig()
    model = PI0FAST(config)
    model.eval()

    tasks = ["pick up the red cube", "open drawer", "push the blue block to the left corner"]
    bsize = len(tasks)
    batch = {
        OBS_IMAGE: torch.rand(bsize, 3, 28, 28),
        OBS_STATE: torch.rand(bsize, config.max_state_dim) * 2 - 1,
        ACTION: torch.randn(bsize, config.chunk_size, config.max_action_dim),
        "task": tasks,
    }
    # Varying action-token lengths, so the right padding also differs per row.
    batch[ACTION][1, 2:] = batch[ACTION][1, :2].amin()

    prefix = model.create_input_tokens(batch[OBS_STATE], batch["task"], actions=None)
    print("prefix lengths (text):", prefix["padded_mask"].sum(1).tolist())

    # Training step (right padding).
    loss = model.forward(batch)["loss"]
    with torch.no_grad():
        ref = reference_loss(model, batch)
    print(f"train loss {loss.item():.6f}  per-sample reference {ref.item():.6f}")
    assert torch.allclose(loss, ref, atol=1e-5), (loss.item(), ref.item())

    # A few optimizer steps, so that generation has learned something to say.
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    first = None
    for _ in range(15):
        loss = model.forward(batch)["loss"]
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"loss {first:.4f} -> {loss.item():.4f} after 15 steps")
    assert loss.item() < first
    model.eval()

    # Generation (left padding, KV cache).
    tokens, logits = model.generate_actions(batch)
    ref_tokens, ref_logits = reference_generate(model, batch, config.max_decoding_steps)
    print("generated:", tokens.tolist())
    print("reference:", ref_tokens.tolist())
    err = (logits - ref_logits).abs().max().item()
    print(f"max |logit - reference| over all steps: {err:.2e}")
    assert torch.equal(tokens, ref_tokens)
    assert err < 1e-4, err

    print("ok")


if __name__ == "__main__":
    main()
