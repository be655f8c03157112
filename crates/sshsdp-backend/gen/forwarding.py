#!/usr/bin/env python3
"""Generates crates/sshsdp-backend/src/ops/*.rs: the forwarding of every Burn ops-trait method
(required and provided) from `Hsdp<B>` to `B`, so B's own fused and specialised kernels are kept.

Float tensors are the only primitives Hsdp wraps (a parameter handle or a local B tensor):
arguments are resolved with `float_in` (a parameter handle becomes a view of its resident bucket),
results wrapped with `float_out`. Int, bool and quantized primitives are B's own and pass through.
Methods listed in OVERRIDES forward to hand-written functions in src/ops/overrides.rs instead.

Usage (rerun after a Burn upgrade; the output is committed):
    python3 crates/sshsdp-backend/gen/forwarding.py [path/to/burn-backend-X.Y.Z]
"""
import glob
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "src", "ops")

# (source file relative to src/backend/ops, trait, output module)
TRAITS = [
    ("tensor.rs", "FloatTensorOps", "float"),
    ("int_tensor.rs", "IntTensorOps", "int"),
    ("bool_tensor.rs", "BoolTensorOps", "bool"),
    ("modules/base.rs", "ModuleOps", "module"),
    ("activation.rs", "ActivationOps", "activation"),
    ("qtensor.rs", "QTensorOps", "qtensor"),
    ("transaction.rs", "TransactionOps", "transaction"),
]

# Hand-written in overrides.rs: they must not gather a parameter (device, grad flags, detach).
OVERRIDES = {"float_device", "float_is_require_grad", "float_set_require_grad", "float_detach"}


def burn_backend_dir():
    if len(sys.argv) > 1:
        return sys.argv[1]
    meta = json.loads(
        subprocess.check_output(
            ["cargo", "metadata", "--format-version", "1"], cwd=os.path.join(HERE, "..")
        )
    )
    for p in meta["packages"]:
        if p["name"] == "burn-backend":
            return os.path.dirname(p["manifest_path"])
    sys.exit("burn-backend not found in cargo metadata")


def strip_comments(src):
    src = re.sub(r"//[^\n]*", "", src)
    return re.sub(r"/\*.*?\*/", "", src, flags=re.S)


def balanced(s, i, open_c, close_c):
    """Index just past the bracket closing the one at s[i]."""
    depth = 0
    while i < len(s):
        if s[i] == open_c:
            depth += 1
        elif s[i] == close_c:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unbalanced")


def split_top(s, sep=","):
    parts, depth, cur = [], 0, ""
    for i, c in enumerate(s):
        if c in "<([":
            depth += 1
        elif c in ">)]" and not (c == ">" and i > 0 and s[i - 1] == "-"):
            depth -= 1
        if c == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def trait_methods(src, trait):
    src = strip_comments(src)
    m = re.search(r"pub trait " + trait + r"<B: Backend>[^{]*\{", src)
    body_start = m.end() - 1
    body = src[body_start + 1 : balanced(src, body_start, "{", "}") - 1]
    i, methods, attrs = 0, [], []
    while i < len(body):
        if body[i].isspace():
            i += 1
            continue
        if body.startswith("#[", i):
            end = balanced(body, i + 1, "[", "]")
            attr = body[i:end]
            if not attr.startswith("#[allow") and not attr.startswith("#[doc"):
                attrs.append(attr)
            i = end
            continue
        fm = re.compile(r"fn\s+(\w+)").match(body, i)
        if not fm:
            raise ValueError("unexpected item in %s: %r" % (trait, body[i : i + 80]))
        name = fm.group(1)
        j = fm.end()
        generics = ""
        if body[j] == "<":
            k = balanced(body, j, "<", ">")
            generics, j = body[j:k], k
        k = balanced(body, j, "(", ")")
        args = body[j + 1 : k - 1]
        j = k
        # Return type and where clause run up to ';' or '{' at bracket depth 0.
        depth, e = 0, j
        while True:
            c = body[e]
            if c in "<([":
                depth += 1
            elif c in ">)]" and body[e - 1] != "-":
                depth -= 1
            elif c in ";{" and depth == 0:
                break
            e += 1
        tail = body[j:e].strip()
        i = balanced(body, e, "{", "}") if body[e] == "{" else e + 1
        ret, where = "", ""
        if tail.startswith("->"):
            tail = tail[2:].strip()
            wm = re.search(r"\bwhere\b", tail)
            ret, where = (tail[: wm.start()].strip(), tail[wm.start() :]) if wm else (tail, "")
        elif tail.startswith("where"):
            where = tail
        methods.append(dict(name=name, generics=generics, args=split_top(args), ret=ret,
                            where=where, attrs=attrs))
        attrs = []
    return methods


def norm(t):
    return " ".join(t.split())


def to_self(t):
    # Paths relative to burn-backend's own crate root become absolute.
    t = re.sub(r"\bcrate::", "burn_backend::", t)
    return re.sub(r"\bB\b", "Self", t)


def convert_arg(name, ty):
    t = norm(ty)
    if t == "FloatTensor<B>":
        return "float_in(%s)" % name
    if t == "Option<FloatTensor<B>>":
        return "%s.map(float_in)" % name
    if t == "Vec<FloatTensor<B>>":
        return "%s.into_iter().map(float_in).collect()" % name
    if t == "TensorPrimitive<B>":
        return "primitive_in(%s)" % name
    if t == "QuantizationParametersPrimitive<B>":
        return "qparams_in(%s)" % name
    if t == "TransactionPrimitive<B>":
        return "transaction_in(%s)" % name
    if "FloatTensor" in t or "B::Float" in t:
        raise ValueError("no conversion for argument type " + t)
    return name


def convert_ret(expr, ty):
    t = norm(ty)
    if t == "FloatTensor<B>":
        return "float_out(%s)" % expr
    if t == "TensorPrimitive<B>":
        return "primitive_out(%s)" % expr
    if t in ("MaxPool1dWithIndices<B>", "MaxPool2dWithIndices<B>"):
        return "{ let r = %s; %s { output: float_out(r.output), indices: r.indices } }" % (expr, t[:-3])
    if t in ("MaxPool1dBackward<B>", "MaxPool2dBackward<B>"):
        return "{ let r = %s; %s { x_grad: float_out(r.x_grad) } }" % (expr, t[:-3])
    if t == "DeformConv2dBackward<B>":
        return "deform_conv2d_backward_out(%s)" % expr
    if t.startswith("(") and "FloatTensor" in t:
        parts = split_top(t[1:-1])
        names = ["r%d" % i for i in range(len(parts))]
        outs = [convert_ret(n, p) for n, p in zip(names, parts)]
        return "{ let (%s) = %s; (%s) }" % (", ".join(names), expr, ", ".join(outs))
    if "FloatTensor" in t:
        raise ValueError("no conversion for return type " + t)
    return expr


def generic_names(generics):
    if not generics:
        return ""
    names = []
    for g in split_top(generics[1:-1]):
        g = g.strip()
        if g.startswith("const "):
            names.append(g.split()[1].rstrip(":"))
        elif not g.startswith("'"):
            names.append(re.split(r"[:\s=]", g)[0])
    return "::<%s>" % ", ".join(names) if names else ""


def emit(method):
    args = []
    call = []
    for a in method["args"]:
        name, ty = [x.strip() for x in a.split(":", 1)]
        name = name.replace("mut ", "").strip()
        args.append("%s: %s" % (name, to_self(norm(ty))))
        if method["name"] not in OVERRIDES:
            call.append(convert_arg(name, ty))
    sig = "fn %s%s(%s)" % (method["name"], method["generics"], ", ".join(args))
    if method["ret"]:
        sig += " -> " + to_self(norm(method["ret"]))
    if method["where"]:
        sig += " " + to_self(norm(method["where"]))
    if method["name"] in OVERRIDES:
        names = [a.split(":", 1)[0].replace("mut ", "").strip() for a in method["args"]]
        body = "overrides::%s::<B>(%s)" % (method["name"], ", ".join(names))
    else:
        call_expr = "B::%s%s(%s)" % (method["name"], generic_names(method["generics"]), ", ".join(call))
        body = convert_ret(call_expr, method["ret"]) if method["ret"] else call_expr
    attrs = "".join("    %s\n" % a for a in method["attrs"])
    return "%s    %s {\n        %s\n    }\n" % (attrs, sig, body)


def main():
    root = burn_backend_dir()
    ops = os.path.join(root, "src", "backend", "ops")
    version = os.path.basename(root.rstrip("/"))
    for src_file, trait, module in TRAITS:
        methods = trait_methods(open(os.path.join(ops, src_file)).read(), trait)
        out = [
            "// @generated by crates/sshsdp-backend/gen/forwarding.py from %s — do not edit.\n" % version,
            "//! `%s` for `Hsdp<B>`: every method forwards to `B` (%d methods).\n\n" % (trait, len(methods)),
            "#![allow(unused_imports, clippy::all)]\n\n",
            "use super::overrides;\nuse super::prelude::*;\n\n",
            "impl<B: Backend> %s<Self> for Hsdp<B> {\n" % trait,
        ]
        out += [emit(m) for m in methods]
        out.append("}\n")
        with open(os.path.join(OUT, module + ".rs"), "w") as f:
            f.write("".join(out))
        print("%-16s %3d methods -> src/ops/%s.rs" % (trait, len(methods), module))


if __name__ == "__main__":
    main()
