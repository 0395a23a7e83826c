"""Text that a careless server, database, page or script mishandles, for the tests that send it
in every field (tests/server/test_adversarial_text.py, tests/browser/test_hostile_text.py)."""

# Valid Unicode: every text field takes it and gives it back as sent.
ACCEPTED = {
    "rtl_override": "\u202egpj.exe\u202c",
    "html": '<script>alert("flx")</script><img src=x onerror=alert(1)>',
    "attribute": "\" onmouseover=alert(1) data-x='",
    "sql": "x'); DROP TABLE processes; --",
    "non_ascii_digits": "\u0661\u0662\u0663\u00b2\u096d",
    "newlines": "a\nb\r\nc\u2028d\u2029e",
    "emoji": "\U0001f680\U0001f469\u200d\U0001f4bb\U0001f3f3\ufe0f\u200d\U0001f308",
    "template": "{{ 7*7 }}{% if 1 %}${7*7}",
    "controls": "\x1b[31mred\x1b[0m\x07\x7f\ufeff",
    "noncharacters": "\uffff\U0010ffff",
}

# Text no database stores and no JSON encoder writes: refused where it comes in, with a 4xx
# naming the field. A lone surrogate is what Python keeps of bytes that are not UTF-8 (file
# names, arguments); PostgreSQL refuses NUL in text.
REFUSED = {
    "lone_surrogate": "donn\udce9es.csv",
    "nul": "a\x00b",
}
