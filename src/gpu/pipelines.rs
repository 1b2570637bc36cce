//! The shader table, a tiny preprocessor for variants, and compute pipelines cached by
//! (shader file, entry point, defines).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Every WGSL file, embedded at build time. One file per kernel family.
pub const SHADERS: &[(&str, &str)] = &[
    ("matmul.wgsl", include_str!("../../shaders/matmul.wgsl")),
    ("norm.wgsl", include_str!("../../shaders/norm.wgsl")),
    (
        "attention.wgsl",
        include_str!("../../shaders/attention.wgsl"),
    ),
    ("moe.wgsl", include_str!("../../shaders/moe.wgsl")),
    (
        "subgroup_probe.wgsl",
        include_str!("../../shaders/subgroup_probe.wgsl"),
    ),
    ("experts.wgsl", include_str!("../../shaders/experts.wgsl")),
    ("router.wgsl", include_str!("../../shaders/router.wgsl")),
    (
        "elementwise.wgsl",
        include_str!("../../shaders/elementwise.wgsl"),
    ),
    (
        "bandwidth.wgsl",
        include_str!("../../shaders/bandwidth.wgsl"),
    ),
];

/// Compile-time variant switches: `#if NAME` / `#else` / `#endif` blocks and `{{NAME}}` tokens.
/// Files a shader pulls in with `#include "name"` (not shaders of their own).
pub const INCLUDES: &[(&str, &str)] = &[
    ("reduce.wgsl", include_str!("../../shaders/reduce.wgsl")),
    ("swiglu.wgsl", include_str!("../../shaders/swiglu.wgsl")),
    (
        "expert_order.wgsl",
        include_str!("../../shaders/expert_order.wgsl"),
    ),
    ("rms.wgsl", include_str!("../../shaders/rms.wgsl")),
];

pub type Defines<'a> = &'a [(&'a str, String)];

/// Applies `defines` to a WGSL source: lines between `#if NAME` and `#else`/`#endif` stay only
/// when NAME is defined to something other than "0"; `{{NAME}}` becomes NAME's value;
/// `#include "name"` inserts an `INCLUDES` file, preprocessed with the same defines.
pub fn preprocess(file: &str, source: &str, defines: Defines) -> Result<String> {
    let value = |name: &str| {
        defines
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    };
    let mut out = String::with_capacity(source.len());
    // Each open #if: (this branch is active, an enclosing branch is active).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    for (number, line) in source.lines().enumerate() {
        let trimmed = line.trim_start();
        let active = stack.last().is_none_or(|(on, parent)| *on && *parent);
        if let Some(name) = trimmed.strip_prefix("#if ") {
            let on = value(name.trim()).is_some_and(|v| v != "0");
            stack.push((on, active));
        } else if trimmed.starts_with("#else") {
            let top = stack
                .last_mut()
                .ok_or_else(|| Error::Gpu(format!("{file}:{}: #else without #if", number + 1)))?;
            top.0 = !top.0;
        } else if trimmed.starts_with("#endif") {
            stack
                .pop()
                .ok_or_else(|| Error::Gpu(format!("{file}:{}: #endif without #if", number + 1)))?;
        } else if let Some(name) = trimmed.strip_prefix("#include ") {
            if active {
                let name = name.trim().trim_matches('"');
                let included = INCLUDES.iter().find(|(n, _)| *n == name).ok_or_else(|| {
                    Error::Gpu(format!("{file}:{}: no include {name}", number + 1))
                })?;
                out.push_str(&preprocess(name, included.1, defines)?);
            }
        } else if active {
            let mut text = line.to_string();
            for (name, v) in defines {
                text = text.replace(&format!("{{{{{name}}}}}"), v);
            }
            out.push_str(&text);
        }
        // Keep line numbers stable for error messages.
        out.push('\n');
    }
    if !stack.is_empty() {
        return Err(Error::Gpu(format!("{file}: unterminated #if")));
    }
    if let Some(start) = out.find("{{") {
        let token: String = out[start..].chars().take(40).collect();
        return Err(Error::Gpu(format!("{file}: undefined token {token}")));
    }
    Ok(out)
}

pub fn shader_source(file: &str) -> Result<&'static str> {
    SHADERS
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, src)| *src)
        .ok_or_else(|| Error::Gpu(format!("no shader named {file}")))
}

type Key = (&'static str, &'static str, String);

/// Compute pipelines by (file, entry point, defines); each is compiled once per device.
#[derive(Default)]
pub struct PipelineCache {
    pipelines: Mutex<HashMap<Key, Arc<wgpu::ComputePipeline>>>,
}

impl PipelineCache {
    pub fn get(
        &self,
        device: &wgpu::Device,
        file: &'static str,
        entry: &'static str,
        defines: Defines,
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let key_defines: Vec<String> = defines.iter().map(|(n, v)| format!("{n}={v}")).collect();
        let key = (file, entry, key_defines.join(","));
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return Ok(p.clone());
        }
        let source = preprocess(file, shader_source(file)?, defines)?;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(file),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(Error::Gpu(format!("{file} ({entry}, {}): {error}", key.2)));
        }
        let pipeline = Arc::new(pipeline);
        self.pipelines.lock().unwrap().insert(key, pipeline.clone());
        Ok(pipeline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preprocessor_selects_branches_and_substitutes() {
        let src = "a\n#if X\nb {{N}}\n#if Y\nc\n#else\nd\n#endif\n#else\ne\n#endif\nf";
        let out = preprocess("t", src, &[("X", "1".into()), ("N", "7".into())]).unwrap();
        let kept: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(kept, ["a", "b 7", "d", "f"]);
        let out = preprocess("t", src, &[("N", "7".into())]).unwrap();
        let kept: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(kept, ["a", "e", "f"]);
        assert!(preprocess("t", "#if X\n", &[]).is_err());
        assert!(preprocess("t", "{{MISSING}}", &[]).is_err());
    }
}
