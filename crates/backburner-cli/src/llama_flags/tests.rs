//! Tests of [`super`]: the table, the guard against clustered short flags, and values that look like flags.

use super::translate;

fn t(a: &[&str]) -> Result<Vec<String>, String> {
    translate(
        std::iter::once("bb")
            .chain(a.iter().copied())
            .map(String::from)
            .collect(),
    )
}

#[test]
fn flags_with_a_meaning_become_long_ones_and_the_rest_are_named() {
    assert_eq!(
        t(&["serve", "-np", "4", "-ub", "256", "-ctk", "f16", "-ctv", "f16", "-fa", "-m", "x"])
            .unwrap()[1..],
        [
            "serve",
            "--parallel",
            "4",
            "--ubatch",
            "256",
            "--kv-dtype",
            "f16",
            "-m",
            "x"
        ]
    );
    assert_eq!(
        t(&["run", "-fa", "on", "-p", "hi"]).unwrap()[1..],
        ["run", "-p", "hi"]
    );
    assert_eq!(
        t(&["run", "-ub=64"]).unwrap()[1..],
        ["run", "--ubatch", "64"]
    );
    assert_eq!(
        t(&["run", "-ngl", "99", "-dev", "CUDA0"]).unwrap()[1..],
        ["run", "--device-layers", "99", "--device", "CUDA0"]
    );
    assert!(t(&["run", "-ngld", "99"])
        .unwrap_err()
        .starts_with("-ngld 99: `backburner run` has no --device-layers"));
    assert!(t(&["plan", "-ngl", "8"])
        .unwrap_err()
        .contains("has no --device-layers"));
    assert_eq!(
        t(&["run", "-ngl", "0", "-no-cnv", "--jinja"]).unwrap()[1..],
        ["run", "--device-layers", "0"]
    );
    assert_eq!(
        t(&["plan", "-ngl", "0", "-ngld", "0"]).unwrap()[1..],
        ["plan"]
    );
    assert_eq!(
        t(&["run", "--n-gpu-layers=99"]).unwrap()[1..],
        ["run", "--device-layers", "99"]
    );
    assert!(t(&["worker", "--n-gpu-layers-draft=2"])
        .unwrap_err()
        .contains("--n-gpu-layers-draft 2"));
    assert_eq!(
        t(&["run", "--flash-attn", "auto", "--cache-type-k", "bf16"]).unwrap()[1..],
        ["run", "--kv-dtype", "bf16"]
    );
    assert_eq!(
        t(&["run", "-m", "x", "-cnv", "-sys", "Be terse.", "--chat"]).unwrap()[1..],
        ["chat", "-m", "x", "--system", "Be terse."]
    );
    assert_eq!(
        t(&["run", "--conversation", "-n", "5"]).unwrap()[1..],
        ["chat", "-n", "5"]
    );
    assert_eq!(t(&["chat", "-cnv"]).unwrap()[1..], ["chat"]);
    assert!(t(&["run", "-cnv", "-p", "hi"])
        .unwrap_err()
        .contains("leave out -p"));
    assert!(t(&["serve", "-cnv"])
        .unwrap_err()
        .contains("backburner run -cnv"));
    assert!(t(&["run", "-b", "2048"]).unwrap_err().contains("-b"));
    assert!(t(&["run", "-fa", "off"]).unwrap_err().contains("-fa off"));
    assert!(t(&["run", "-ctk", "f16", "-ctv", "bf16"])
        .unwrap_err()
        .contains("-ctk and -ctv"));
    assert!(t(&["run", "-ub"]).unwrap_err().contains("needs a value"));
    // one-letter flags and values after `--` pass untouched
    assert_eq!(
        t(&["run", "-n", "5", "-t", "2"]).unwrap()[1..],
        ["run", "-n", "5", "-t", "2"]
    );
    assert_eq!(
        t(&["run", "--", "-ngl"]).unwrap()[1..],
        ["run", "--", "-ngl"]
    );
}

fn err(a: &[&str]) -> String {
    t(a).unwrap_err()
}

#[test]
fn new_entries_have_their_meanings() {
    // accepted: what they ask for happens anyway
    for a in [
        &["run", "-st"][..],
        &["run", "--single-turn"],
        &["serve", "-cb"],
        &["serve", "--cont-batching"],
        &["serve", "--metrics", "--slots"],
        &["run", "--no-warmup", "--no-mmap", "-cmoe"],
        &["serve", "--cpu-moe"],
        &["run", "--reasoning-budget", "-1"],
        &["run", "--repeat-last-n", "-1"],
    ] {
        assert_eq!(t(a).unwrap()[1..], a[..1], "{a:?}");
    }
    // rewritten
    assert_eq!(
        t(&["serve", "-a", "q", "--max-model-len", "4096"]).unwrap()[1..],
        ["serve", "--alias", "q", "--ctx-size", "4096"]
    );
    assert_eq!(
        t(&["serve", "--served-model-name=q"]).unwrap()[1..],
        ["serve", "--alias", "q"]
    );
    assert_eq!(
        t(&["run", "-r", "User:", "--reverse-prompt", "-x"]).unwrap()[1..],
        ["run", "--stop", "User:", "--stop", "-x"]
    );
    assert_eq!(
        t(&["run", "--chat", "--reasoning-budget", "0"]).unwrap()[1..],
        ["run", "--chat", "--no-think"]
    );
    assert_eq!(
        t(&["chat", "--reasoning-budget=0"]).unwrap()[1..],
        ["chat", "--no-think"]
    );
    // refused, naming the flag and why
    assert!(err(&["serve", "-nocb"])
        .starts_with("-nocb (llama.cpp's flag) has no meaning here: serve always"));
    assert!(err(&["run", "--mlock"]).contains("not supported"));
    // --device is this CLI's own flag (llama.cpp's device names parse: `none`, `CUDA0`)
    assert_eq!(
        t(&["serve", "--device", "none"]).unwrap()[1..],
        ["serve", "--device", "none"]
    );
    assert!(err(&["chat", "-st"]).contains("backburner run --chat -p"));
    assert!(err(&["run", "-ot", "exps=CPU"]).contains("--expert-split"));
    assert!(!err(&["run", "-ot", "x"]).contains("--experts-worker"));
    assert!(err(&["run", "--reasoning-budget", "512"]).contains("no thinking budget"));
    assert!(err(&["serve", "--reasoning-budget", "0"]).contains("--no-think here"));
    let e = err(&["run", "--repeat-last-n", "64"]);
    assert!(
        e.contains("--repeat-last-n 64") && e.contains("whole context"),
        "{e}"
    );
    // a rewrite to a flag the command lacks names both
    assert_eq!(
        err(&["run", "-a", "x"]),
        "-a (--alias here) is not a flag of `backburner run`; see `backburner run --help`"
    );
    assert!(err(&["chat", "-r", "x"]).contains("(--stop here) is not a flag of `backburner chat`"));
    assert!(err(&["serve", "-sys", "x"]).contains("not a flag of `backburner serve`"));
}

#[test]
fn other_multi_letter_short_flags_are_refused_where_a_flag_stands() {
    for (a, flag) in [
        (&["run", "-sp"][..], "-sp"),
        (&["run", "-sysf", "sys.txt"], "-sysf"),
        (&["run", "-co"], "-co"),
        (&["run", "-fit", "on"], "-fit"),
        (&["run", "-fit=on"], "-fit"),
        (&["run", "-lv", "3"], "-lv"),
        (&["serve", "-kvu"], "-kvu"),
        (&["chat", "-xy-z9"], "-xy-z9"),
        (&["bench", "local", "-ab"], "-ab"),
    ] {
        let e = err(a);
        assert!(
            e.starts_with(&format!("{flag} is not a flag of `backburner ")),
            "{a:?}: {e}"
        );
        assert!(e.contains("--help"), "{e}");
    }
    assert_eq!(
        err(&["run", "-sysf", "x"]),
        "-sysf is not a flag of `backburner run`; see `backburner run --help` (a value of -s goes after a \
         space: `-s ysf`)"
    );
    assert_eq!(
        err(&["bench", "local", "-ab"]),
        "-ab is not a flag of `backburner bench local`; see `backburner bench local --help`"
    );
    // the value of a flag that takes one passes untouched, however it looks (clap's own table says which do)
    for a in [
        &["run", "-p", "-st"][..],
        &["run", "--prompt", "-fa"],
        &["run", "--stop", "-xy", "-s", "-1"],
        &["run", "--seed", "-1"],
        &["run", "-n", "-1"],
        &["run", "-m", "-ngl", "--logit-bias", "-ab"],
        &["chat", "--system", "-sys"],
        &["serve", "--alias", "-cb", "--api-key", "-nocb"],
        &["perplexity", "-f", "-cnv"],
        &["bench", "local", "-m", "-ot"],
    ] {
        assert_eq!(t(a).unwrap()[1..], a[..], "{a:?}");
    }
    // after a value given inline, or a flag without a value, the next argument stands where a flag does
    assert!(err(&["run", "--seed=5", "-st", "-xy"]).starts_with("-xy is not"));
    assert!(err(&["run", "-s5", "-xy"]).starts_with("-xy is not"));
    assert!(err(&["run", "--json", "-xy"]).starts_with("-xy is not"));
    assert!(err(&["run", "--chat", "-fa", "-xy"]).starts_with("-xy is not"));
    // the table's flags are read only where a flag stands: `-p -fa` is the prompt `-fa`
    assert_eq!(
        t(&["run", "-p", "-fa", "-ngl", "0"]).unwrap()[1..],
        ["run", "-p", "-fa", "--device-layers", "0"]
    );
    assert_eq!(
        t(&["run", "-p", "-ngl", "-ub", "8"]).unwrap()[1..],
        ["run", "-p", "-ngl", "--ubatch", "8"]
    );
    // a command's own flag of the same name is its own
    assert_eq!(
        t(&["bench", "slots", "--slots", "1,2", "-ub", "8"]).unwrap()[1..],
        ["bench", "slots", "--slots", "1,2", "--ubatch", "8"]
    );
    // one-letter flags, negative numbers and words still go to clap as they are
    assert_eq!(
        t(&["run", "-n5", "-1", "x"]).unwrap()[1..],
        ["run", "-n5", "-1", "x"]
    );
    assert_eq!(t(&["-V"]).unwrap()[1..], ["-V"]);
}

#[test]
fn chat_points_a_prompt_to_run() {
    for a in [
        &["chat", "-p", "hi"][..],
        &["chat", "--prompt=hi"],
        &["chat", "-f", "x.txt"],
        &["chat", "-m", "x", "hello there"],
    ] {
        let e = err(a);
        assert!(
            e.contains("it reads its messages from the terminal"),
            "{a:?}: {e}"
        );
        assert!(e.contains("backburner run --chat -p"), "{e}");
    }
    assert!(err(&["chat", "hello there"]).contains("`backburner run --chat -p \"hello there\"`"));
    // a value that is a word is no message
    assert_eq!(
        t(&["chat", "-m", "x", "-n", "4"]).unwrap()[1..],
        ["chat", "-m", "x", "-n", "4"]
    );
}

/// The guard's premise: every short flag of every command takes a value, but -h (and the top level's -V), so
/// `-` and two letters is never a cluster of one-letter flags.
#[test]
fn every_short_flag_takes_a_value() {
    fn walk(c: &clap::Command, path: &str) {
        for a in c.get_arguments() {
            if let Some(s) = a.get_short() {
                assert!(
                    a.get_action().takes_values() || s == 'h' || (path.is_empty() && s == 'V'),
                    "{path} -{s} takes no value"
                );
            }
        }
        for sc in c.get_subcommands() {
            walk(sc, &format!("{path} {}", sc.get_name()));
        }
    }
    let mut c = crate::cli_command();
    c.build();
    walk(&c, "");
}
