//! Spec lists of common model shapes, for benchmarks, examples and sizing a cluster.

use crate::{DType, ParamSpec};

/// Shape of a decoder-only transformer in the Llama family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransformerShape {
    /// Decoder layers.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// MLP inner width (SwiGLU: gate, up and down matrices).
    pub ffn: usize,
    /// Key/value width (grouped-query attention; `hidden` for full multi-head).
    pub kv: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl TransformerShape {
    /// Llama-2/3-70B-class: 80 layers, 8192 wide, 28672 MLP, 1024 KV, 128k vocabulary.
    pub fn llama_70b() -> Self {
        Self {
            layers: 80,
            hidden: 8192,
            ffn: 28672,
            kv: 1024,
            vocab: 128_256,
        }
    }

    /// Llama-2-7B-class: 32 layers, 4096 wide, 11008 MLP, full KV, 32k vocabulary.
    pub fn llama_7b() -> Self {
        Self {
            layers: 32,
            hidden: 4096,
            ffn: 11008,
            kv: 4096,
            vocab: 32_000,
        }
    }

    /// GPT-2-small-class: 12 layers, 768 wide, 3072 MLP, 50k vocabulary.
    pub fn gpt_small() -> Self {
        Self {
            layers: 12,
            hidden: 768,
            ffn: 3072,
            kv: 768,
            vocab: 50_257,
        }
    }

    /// The parameter specs in execution order, weights stored `[d_input, d_output]` as Burn's
    /// `Linear` does: embedding, per layer (norm, q, k, v, o, norm, gate, up, down), final
    /// norm, LM head.
    pub fn specs(&self, dtype: DType) -> Vec<ParamSpec> {
        let (h, f, kv) = (self.hidden, self.ffn, self.kv);
        let mut specs = vec![ParamSpec::new(
            "tok_embeddings.weight",
            vec![self.vocab, h],
            dtype,
        )];
        for l in 0..self.layers {
            let p = |name: &str| format!("layers.{l}.{name}");
            specs.extend([
                ParamSpec::new(p("attention_norm.gamma"), vec![h], dtype),
                ParamSpec::new(p("attention.wq.weight"), vec![h, h], dtype),
                ParamSpec::new(p("attention.wk.weight"), vec![h, kv], dtype),
                ParamSpec::new(p("attention.wv.weight"), vec![h, kv], dtype),
                ParamSpec::new(p("attention.wo.weight"), vec![h, h], dtype),
                ParamSpec::new(p("ffn_norm.gamma"), vec![h], dtype),
                ParamSpec::new(p("feed_forward.w1.weight"), vec![h, f], dtype),
                ParamSpec::new(p("feed_forward.w3.weight"), vec![h, f], dtype),
                ParamSpec::new(p("feed_forward.w2.weight"), vec![f, h], dtype),
            ]);
        }
        specs.push(ParamSpec::new("norm.gamma", vec![h], dtype));
        specs.push(ParamSpec::new("lm_head.weight", vec![h, self.vocab], dtype));
        specs
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.with_order(i as u64))
            .collect()
    }
}
