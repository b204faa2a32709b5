module @jit__lambda attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2, "model"=4]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}, {name = "model", size = 4 : i64}]}}
  func.func public @main(%arg0: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data", "model"}, {}]>}, %arg1: tensor<32x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"model"}]>}) -> (tensor<64x64xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {"model"}]>}) {
    %0 = sdy.manual_computation(%arg0, %arg1) in_shardings=[<@mesh, [{"data", "model"}, {}]>, <@mesh, [{}, {"model"}]>] out_shardings=[<@mesh, [{"data"}, {"model"}]>] manual_axes={"data", "model"} (%arg2: tensor<8x32xf32>, %arg3: tensor<32x16xf32>) {
      %c = stablehlo.constant dense<[0, 1, 2, 3, 0, 1, 2, 3]> : tensor<8xi32>
      %1 = stablehlo.partition_id : tensor<ui32>
      %2 = stablehlo.convert %1 : (tensor<ui32>) -> tensor<i32>
      %3 = stablehlo.dynamic_slice %c, %2, sizes = [1] : (tensor<8xi32>, tensor<i32>) -> tensor<1xi32>
      %4 = stablehlo.reshape %3 : (tensor<1xi32>) -> tensor<i32>
      %cst = stablehlo.constant dense<0.000000e+00> : tensor<32x16xf32>
      %c_0 = stablehlo.constant dense<0> : tensor<i32>
      %5:3 = stablehlo.while(%iterArg = %c_0, %iterArg_4 = %arg2, %iterArg_5 = %cst) : tensor<i32>, tensor<8x32xf32>, tensor<32x16xf32>
      cond {
        %c_6 = stablehlo.constant dense<3> : tensor<i32>
        %11 = stablehlo.compare LT, %iterArg, %c_6, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %11 : tensor<i1>
      } do {
        %11 = "stablehlo.collective_permute"(%iterArg_4) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 3], [1, 0], [2, 1], [3, 2], [4, 7], [5, 4], [6, 5], [7, 6]]> : tensor<8x2xi64>}> : (tensor<8x32xf32>) -> tensor<8x32xf32>
        %12 = stablehlo.add %4, %iterArg : tensor<i32>
        %c_6 = stablehlo.constant dense<4> : tensor<i32>
        %13 = stablehlo.remainder %12, %c_6 : tensor<i32>
        %14 = stablehlo.dot_general %iterArg_4, %arg3, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
        %c_7 = stablehlo.constant dense<8> : tensor<i32>
        %15 = stablehlo.multiply %13, %c_7 : tensor<i32>
        %c_8 = stablehlo.constant dense<0> : tensor<i32>
        %16 = stablehlo.dynamic_update_slice %iterArg_5, %14, %15, %c_8 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<i32>, tensor<i32>) -> tensor<32x16xf32>
        %c_9 = stablehlo.constant dense<1> : tensor<i32>
        %17 = stablehlo.add %iterArg, %c_9 : tensor<i32>
        stablehlo.return %17, %11, %16 : tensor<i32>, tensor<8x32xf32>, tensor<32x16xf32>
      }
      %c_1 = stablehlo.constant dense<3> : tensor<i32>
      %6 = stablehlo.add %4, %c_1 : tensor<i32>
      %c_2 = stablehlo.constant dense<4> : tensor<i32>
      %7 = stablehlo.remainder %6, %c_2 : tensor<i32>
      %8 = stablehlo.dot_general %5#1, %arg3, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
      %c_3 = stablehlo.constant dense<8> : tensor<i32>
      %9 = stablehlo.multiply %7, %c_3 : tensor<i32>
      %10 = stablehlo.dynamic_update_slice %5#2, %8, %9, %c_0 : (tensor<32x16xf32>, tensor<8x16xf32>, tensor<i32>, tensor<i32>) -> tensor<32x16xf32>
      sdy.return %10 : tensor<32x16xf32>
    } : (tensor<64x32xf32>, tensor<32x64xf32>) -> tensor<64x64xf32>
    return %0 : tensor<64x64xf32>
  }
}
