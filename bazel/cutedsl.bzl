"""`cutedsl_aot`: CuTe DSL kernels compiled ahead of time, as a C++ library.

Runs `script --out DIR --arch ARCH` (kernels/cutedsl/build_aot.py), which writes one `.o` (x86-64
ELF embedding the cubin) and one `.h` per exported kernel into DIR. Their names are the script's
business, so DIR is a tree artifact: its headers are exposed with DIR on the include path, and its
objects are archived into one static library that is linked whole, as CMake links the objects
themselves.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _compile_kernels(ctx):
    out_dir = ctx.actions.declare_directory(ctx.label.name)
    ctx.actions.run(
        executable = ctx.executable._python,
        arguments = [ctx.file.script.path, "--out", out_dir.path, "--arch", ctx.attr.arch],
        inputs = ctx.files.srcs + [ctx.file.script],
        outputs = [out_dir],
        mnemonic = "CuteDslAot",
        progress_message = "CuTe DSL ahead-of-time compile for %s" % ctx.attr.arch,
        use_default_shell_env = True,
    )
    return out_dir

def _archive_objects(ctx, cc_toolchain, out_dir):
    archive = ctx.actions.declare_file("lib%s.a" % ctx.label.name)
    ctx.actions.run_shell(
        # The object names are only known once the script has run, hence the shell glob.
        command = 'rm -f "$2" && "$1" rcs "$2" "$3"/*.o',
        arguments = [cc_toolchain.ar_executable, archive.path, out_dir.path],
        inputs = [out_dir],
        outputs = [archive],
        tools = cc_toolchain.all_files,
        mnemonic = "CuteDslArchive",
    )
    return archive

def _cutedsl_aot_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    out_dir = _compile_kernels(ctx)
    archive = _archive_objects(ctx, cc_toolchain, out_dir)
    feature_configuration = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    library = cc_common.create_library_to_link(
        actions = ctx.actions,
        feature_configuration = feature_configuration,
        cc_toolchain = cc_toolchain,
        static_library = archive,
        alwayslink = True,
    )
    linker_input = cc_common.create_linker_input(owner = ctx.label, libraries = depset([library]))
    own = CcInfo(
        compilation_context = cc_common.create_compilation_context(
            headers = depset([out_dir]),
            includes = depset([out_dir.path]),
        ),
        linking_context = cc_common.create_linking_context(linker_inputs = depset([linker_input])),
    )
    return [
        DefaultInfo(files = depset([out_dir, archive])),
        cc_common.merge_cc_infos(cc_infos = [own] + [dep[CcInfo] for dep in ctx.attr.deps]),
    ]

cutedsl_aot = rule(
    implementation = _cutedsl_aot_impl,
    attrs = {
        "script": attr.label(allow_single_file = [".py"], mandatory = True),
        "srcs": attr.label_list(allow_files = True, doc = "files the script reads (kernel modules)"),
        "arch": attr.string(mandatory = True, doc = "GPU architecture, e.g. sm_90a"),
        "deps": attr.label_list(providers = [CcInfo], doc = "what the objects need at link time"),
        "_python": attr.label(
            default = "@local_python//:python",
            allow_single_file = True,
            executable = True,
            cfg = "host",
        ),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
    doc = "CuTe DSL kernels compiled ahead of time: headers plus a whole-archive library.",
)
