//! Python semantics of the helpers behind the chat template's filters and methods, on the exact sets Python uses.

use backburner_model::chat::{
    float_repr, is_py_space, py_split, py_splitlines, py_strip, str_repr,
};

#[test]
fn python_whitespace_is_exactly_str_isspace() {
    // [c for c in range(0x110000) if chr(c).isspace()] in CPython 3.11 (Unicode 14).
    let python: Vec<u32> = vec![
        0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001,
        0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029,
        0x202f, 0x205f, 0x3000,
    ];
    let ours: Vec<u32> = (0..=0x10ffffu32)
        .filter_map(char::from_u32)
        .filter(|c| is_py_space(*c))
        .map(|c| c as u32)
        .collect();
    assert_eq!(ours, python);
}

#[test]
fn strip_drops_information_separators_as_python_does() {
    assert_eq!(py_strip("\x1chi\x1f", None, true, true), "hi");
    assert_eq!(
        py_strip("\u{3000}\u{85}hi\u{a0}\u{2028}", None, true, false),
        "hi\u{a0}\u{2028}"
    );
    assert_eq!(
        py_strip("\u{200b}hi\u{200b}", None, true, true),
        "\u{200b}hi\u{200b}"
    );
    assert_eq!(py_strip("\n\nx\n\n", Some("\n"), false, true), "\n\nx");
    assert_eq!(py_strip("abcxba", Some("ab"), true, true), "cx");
    assert_eq!(py_strip("  x ", Some(""), true, true), "  x ");
}

#[test]
fn split_follows_python_for_whitespace_separators_and_limits() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        py_split("a\x1fb\x1cc d", None, -1, false).unwrap(),
        s(&["a", "b", "c", "d"])
    );
    assert_eq!(
        py_split("  a b  ", None, 1, false).unwrap(),
        s(&["a", "b  "])
    );
    assert_eq!(
        py_split("  a b  ", None, 1, true).unwrap(),
        s(&["  a", "b"])
    );
    assert_eq!(
        py_split("   ", None, -1, false).unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        py_split("a,b,,c", Some(","), -1, false).unwrap(),
        s(&["a", "b", "", "c"])
    );
    assert_eq!(
        py_split("a,b,c", Some(","), 1, true).unwrap(),
        s(&["a,b", "c"])
    );
    assert_eq!(py_split("", Some(","), -1, false).unwrap(), s(&[""]));
    assert!(py_split("abc", Some(""), -1, false).is_err());
    assert_eq!(
        py_splitlines("a\r\nb\x1cc\u{2028}", true),
        s(&["a\r\n", "b\x1c", "c\u{2028}"])
    );
}

#[test]
fn floats_print_as_python_repr() {
    for (x, want) in [
        (0.0, "0.0"),
        (-0.0, "-0.0"),
        (1.0, "1.0"),
        (2.5, "2.5"),
        (0.1, "0.1"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (1.5e-5, "1.5e-05"),
        (0.0001, "0.0001"),
        (123456789.125, "123456789.125"),
        (-1e-7, "-1e-07"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (f64::INFINITY, "inf"),
    ] {
        assert_eq!(float_repr(x), want, "{x}");
    }
}

#[test]
fn strings_repr_as_python_does() {
    assert_eq!(str_repr("it's"), "\"it's\"");
    assert_eq!(str_repr("say \"hi\""), "'say \"hi\"'");
    assert_eq!(str_repr("both ' and \""), "'both \\' and \"'");
    assert_eq!(str_repr("tab\tnl\n\\"), "'tab\\tnl\\n\\\\'");
    assert_eq!(
        str_repr("\x1f\u{85}\u{a0}\u{2028}\u{3000}é中"),
        "'\\x1f\\x85\\xa0\\u2028\\u3000é中'"
    );
    assert_eq!(
        str_repr("\u{feff}\u{e000}\u{100000}"),
        "'\\ufeff\\ue000\\U00100000'"
    );
}
