fn main() {
    eprintln!("kinference-agent: not built yet");
    std::process::exit(2);
}
