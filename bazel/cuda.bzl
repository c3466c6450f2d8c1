"""`cuda_objects`: compile CUDA and C++ sources with nvcc into position-independent objects.

A small stand-in for rules_cuda (which Bazel would have to download): one nvcc action per source,
the C++ toolchain's compiler as nvcc's host compiler, include paths and headers taken from `deps`'
`CcInfo`. The objects go into a `cc_binary`'s `srcs`; nothing here links.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _object_for(ctx, src):
    stem = src.short_path.rpartition(".")[0]
    return ctx.actions.declare_file("_objs/%s/%s.pic.o" % (ctx.label.name, stem))

def _include_flags(compilation_contexts):
    flags = ["-I."]
    for context in compilation_contexts:
        flags += ["-I" + path for path in context.quote_includes.to_list()]
        flags += ["-I" + path for path in context.includes.to_list()]
        for path in context.system_includes.to_list():
            flags += ["-isystem", path]
        flags += ["-D" + define for define in context.defines.to_list()]
    return flags

def _cuda_objects_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    contexts = [dep[CcInfo].compilation_context for dep in ctx.attr.deps]
    headers = depset(ctx.files.hdrs, transitive = [context.headers for context in contexts])
    common = (["-ccbin", cc_toolchain.compiler_executable, "-x", "cu"] + ctx.attr.copts +
              _include_flags(contexts))
    objects = []
    for src in ctx.files.srcs:
        obj = _object_for(ctx, src)
        ctx.actions.run(
            executable = ctx.executable._nvcc,
            arguments = common + ["-c", src.path, "-o", obj.path],
            inputs = depset([src], transitive = [headers]),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "nvcc %s" % src.short_path,
            # nvcc finds gcc's assembler and its own tools through PATH.
            use_default_shell_env = True,
        )
        objects.append(obj)
    return [DefaultInfo(files = depset(objects))]

cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu", ".cc"], doc = "compiled as CUDA (`-x cu`)"),
        "hdrs": attr.label_list(allow_files = [".h", ".hpp", ".cuh", ".inc"], doc = "headers the sources include"),
        "deps": attr.label_list(providers = [CcInfo], doc = "headers and include paths"),
        "copts": attr.string_list(doc = "nvcc flags: architecture, standard, optimisation"),
        "_nvcc": attr.label(
            default = "@local_cuda//:nvcc",
            allow_single_file = True,
            executable = True,
            cfg = "host",
        ),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
    doc = "nvcc-compiled position-independent objects, one per source.",
)
