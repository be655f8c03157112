//! Plans a model over a mesh and prints the layout summary and per-rank memory: size a
//! cluster before having one.
//!
//! ```text
//! cargo run --release --example plan_model -- [gpt-small|llama-7b|llama-70b] [REPLICASxSHARDS]
//!     [hierarchical|hsdp|ddp] [bf16|f32|mxfp8]
//! ```
//! Defaults: `llama-7b 2x8 hierarchical bf16`.

use std::process::ExitCode;

use sshsdp::plan::presets::TransformerShape;
use sshsdp::plan::{DType, Mesh, Plan, PlanConfig, RuntimeFormat, Sharding};

fn parse(args: &[String]) -> Result<(TransformerShape, Mesh, Sharding, RuntimeFormat), String> {
    let get = |i: usize, default: &str| args.get(i).cloned().unwrap_or(default.to_string());
    let model = match get(0, "llama-7b").as_str() {
        "gpt-small" => TransformerShape::gpt_small(),
        "llama-7b" => TransformerShape::llama_7b(),
        "llama-70b" => TransformerShape::llama_70b(),
        other => {
            return Err(format!(
                "unknown model `{other}` (gpt-small, llama-7b, llama-70b)"
            ))
        }
    };
    let mesh_arg = get(1, "2x8");
    let (r, s) = mesh_arg
        .split_once('x')
        .ok_or_else(|| format!("mesh `{mesh_arg}` is not REPLICASxSHARDS"))?;
    let number = |x: &str| {
        x.parse::<usize>()
            .map_err(|e| format!("mesh `{mesh_arg}`: {e}"))
    };
    let mesh = Mesh::new(number(r)?, number(s)?).map_err(|e| e.to_string())?;
    let sharding = match get(2, "hierarchical").as_str() {
        "hierarchical" => Sharding::Hierarchical,
        "hsdp" => Sharding::Hsdp,
        "ddp" => Sharding::Ddp,
        other => {
            return Err(format!(
                "unknown sharding `{other}` (hierarchical, hsdp, ddp)"
            ))
        }
    };
    let format = match get(3, "bf16").as_str() {
        "bf16" => RuntimeFormat::Bf16,
        "f32" => RuntimeFormat::F32,
        "mxfp8" => RuntimeFormat::Mxfp8,
        other => return Err(format!("unknown format `{other}` (bf16, f32, mxfp8)")),
    };
    Ok((model, mesh, sharding, format))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (model, mesh, sharding, format) = match parse(&args) {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::FAILURE;
        }
    };
    let config = PlanConfig::default()
        .with_sharding(sharding)
        .with_format(format);
    match Plan::build(model.specs(DType::Bf16), mesh, config) {
        Ok(plan) => {
            println!("{plan}\n");
            println!("{}", plan.memory());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
