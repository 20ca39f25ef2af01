fn main() {
    eprintln!("vllm-sim: not built yet");
    std::process::exit(2);
}
